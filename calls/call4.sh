#!/usr/bin/env bash
# Device call 4 (4 GPUs). Phase 1 side by side: GPUs 0,1 the GPT at 8 x 4096 / 32 heads / seq 4096, pp=2, peerline
# ZB-H1 and ZBV graphs (the lean weight pass) against the plain torch GPT's 1F1B, blocks eager and torch.compile'd,
# both recipes; GPUs 2,3 the MLP pipeline at pp=2 M=16 (compute16). Phase 2, 4 GPUs: the MLP pipeline at pp=4 M=16,
# then the GPT at 8 x 4096 at pp=4 as time allows. Every bench here is device-bound (its anchor's host lead is large).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
GPT="--gpt-configs compute --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-variants torch,graph
  --gpt-schedules zb-h1,zbv --gpt-precisions bf16 --gpt-anchor-compile both --gpt-anchor-schedules 1f1b --reps 3 --warmup 1"
MLP="--pipeline-configs compute16 --schedules 1f1b,zb-h1,zbv --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv
  --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1"
( export CUDA_VISIBLE_DEVICES=0,1
  timeout -k 10 215 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt $GPT --out $B/gpt-pp2 > $B/gpt-pp2.log 2>&1
  echo "gpt-pp2 rc=$? at $SECONDS s" >> $B/gpt-pp2.log ) &
sleep 5
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 200 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py pipeline $MLP \
    --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 90 torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline $MLP --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
left=$((400 - SECONDS))
if [ $left -gt 60 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=4 launch/bench.py gpt $GPT --out $B/gpt-pp4 > $B/gpt-pp4.log 2>&1
  echo "gpt-pp4 rc=$? at $SECONDS s" >> $B/gpt-pp4.log
fi
{ for r in gpt-pp2 mlp-pp2 mlp-pp4 gpt-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
