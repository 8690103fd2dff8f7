#!/usr/bin/env bash
# Device call 1 (4 GPUs). Phase 1, 4 GPUs: the gpt suite at pp=4, compute shape: peerline 1F1B / ZB-H1 / ZBV graphs
# (bf16) x --zb-memory fast,1f1b against the plain torch GPT's 1F1B, eager and torch.compile'd blocks, both recipes.
# Phase 2 side by side: GPUs 0,1 the GPT at 8 x 4096 / seq 4096, pp=2 (ZB-H1 / ZBV x fast,1f1b); GPUs 2,3 the GPT
# at 16 x 3072 / 24 heads / seq 1024 / micro-batch 2, pp=2 (1F1B / ZB-H1 / ZBV). Both device-bound shapes.
# Phase 3, 4 GPUs: the MLP pipeline at pp=4, M=8. GPU clocks and power sampled throughout.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree dbb87a7; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 250 > $B/clocks.csv 2>&1 &
SMI=$!
COMMON="--gpt-variants torch,graph --gpt-precisions bf16 --gpt-anchor-compile both --gpt-anchor-schedules 1f1b --reps 3 --warmup 1"
timeout -k 10 230 torchrun --standalone --nproc_per_node=4 launch/bench.py gpt --gpt-configs compute \
  --gpt-schedules 1f1b,zb-h1,zbv --gpt-zb-memory fast,1f1b $COMMON --out $B/gpt-pp4 > $B/gpt-pp4.log 2>&1
echo "gpt-pp4 rc=$? at $SECONDS s" >> $B/gpt-pp4.log
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
( export CUDA_VISIBLE_DEVICES=0,1
  timeout -k 10 200 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-schedules zb-h1,zbv --gpt-zb-memory fast,1f1b \
    $COMMON --out $B/gpt-8x4096-pp2 > $B/gpt-8x4096-pp2.log 2>&1
  echo "gpt-8x4096-pp2 rc=$? at $SECONDS s" >> $B/gpt-8x4096-pp2.log ) &
sleep 5
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 200 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-layers 16 --gpt-hidden 3072 --gpt-heads 24 --gpt-seq 1024 --gpt-mbs 2 --gpt-schedules 1f1b,zb-h1,zbv \
    $COMMON --out $B/gpt-16x3072-pp2 > $B/gpt-16x3072-pp2.log 2>&1
  echo "gpt-16x3072-pp2 rc=$? at $SECONDS s" >> $B/gpt-16x3072-pp2.log ) &
wait
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
left=$((560 - SECONDS))
if [ $left -gt 50 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
    --schedules 1f1b,zb-h1,zbv --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
    --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
  echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
fi
kill $SMI 2>/dev/null
{ for r in gpt-pp4 gpt-8x4096-pp2 gpt-16x3072-pp2 mlp-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; done; } > $OUT/results.md
for r in gpt-pp4 gpt-8x4096-pp2 gpt-16x3072-pp2 mlp-pp4; do tail -n 40 $B/$r.log > $OUT/$r-log-tail.txt 2>/dev/null; done
cp $B/clocks.csv $OUT/ 2>/dev/null
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
