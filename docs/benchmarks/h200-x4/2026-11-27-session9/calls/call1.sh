#!/usr/bin/env bash
# Device call 1 (4 GPUs). Phase 1, side by side: GPU 0 tools/kernels_card.sh (re-tune with pl_flat, kernel GPU
# tests, hostcost); GPU 1 the GPT block host probe --rope-parts, then the kernels suite 1 MiB - 1 GiB; GPUs 2,3 the
# MLP pipeline bench at pp=2 M=8 (1F1B, ZB-H1: torch, eager with timelines, graph). Phase 2, alone on 4 GPUs: the
# same bench at pp=4 M=8.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0
  OUT=/tmp/card LIMIT=200 BENCH_LIMIT=90 timeout -k 5 330 bash tools/kernels_card.sh -v > /tmp/card.log 2>&1
  echo "kernels_card rc=$? at $SECONDS s" >> $OUT/machine.txt
  cp kernels/card_plans.json /tmp/card/card_plans_after.json; cp /tmp/card.log /tmp/card/ 2>/dev/null
  tar -czf $OUT/card.tgz -C /tmp/card --exclude=w . ) &
sleep 8
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 120 python3 tools/gpu_probes/gpt_block_host_probe.py --rope-parts > $B/probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $B/probe.txt
  timeout -k 5 200 python3 -m peerline.bench.suites.kernels --sizes-mib 1,2,4,8,16,64,256,1024 --no-variants \
    --out $B/kernels > $B/kernels.log 2>&1
  echo "kernels rc=$? at $SECONDS s" >> $B/kernels.log ) &
sleep 8
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 280 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute \
    --schedules 1f1b,zb-h1 --variants torch,eager,graph --pipeline-anchor-schedules 1f1b,zbv \
    --pipeline-anchor-recipes bf16-params --pipeline-timeline --reps 3 --warmup 1 --out $B/pp2 > $B/pp2.log 2>&1
  echo "pp2 rc=$? at $SECONDS s" >> $B/pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((555 - SECONDS)) torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
  --schedules 1f1b,zb-h1 --variants torch,eager,graph --pipeline-anchor-schedules 1f1b,zbv \
  --pipeline-anchor-recipes bf16-params --pipeline-timeline --reps 3 --warmup 1 --out $B/pp4 > $B/pp4.log 2>&1
echo "pp4 rc=$? at $SECONDS s" >> $B/pp4.log
cp $B/probe.txt $OUT/ 2>/dev/null
{ for r in kernels pp2 pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
