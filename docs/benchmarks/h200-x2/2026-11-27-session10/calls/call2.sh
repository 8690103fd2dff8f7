#!/usr/bin/env bash
# Device call 2 (2 x H100 asked). Phase 1 side by side: GPU 0 the one-GPU eager profiles with traces (mid bf16,
# launch bf16); GPU 1 on an H100 tools/kernels_card.sh (the H100 entry), on an H200 the 8 x 4096 stage probe.
# Phase 2: the gpt suite's eager rows at pp=2 and the one-GPU eager GPT (--gpt-single), launch and compute shapes.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B/traces
( export CUDA_VISIBLE_DEVICES=0
  for c in "mid bf16" "launch bf16"; do set -- $c
    echo "=== $1 $2" >> $B/profile.txt
    PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu_probes timeout -k 5 100 python3 tools/gpu_probes/eager_single_profile.py \
      --config $1 --recipe $2 --top 40 --trace-dir $B/traces/$1-$2 >> $B/profile.txt 2>&1
    echo "profile rc=$? at $SECONDS s" >> $B/profile.txt
  done ) &
sleep 5
( export CUDA_VISIBLE_DEVICES=1
  if nvidia-smi -i 1 --query-gpu=name --format=csv,noheader | grep -q H100; then
    OUT=/tmp/card LIMIT=200 BENCH_LIMIT=90 timeout -k 5 330 bash tools/kernels_card.sh -v > /tmp/card.log 2>&1
    echo "kernels_card rc=$? at $SECONDS s" >> $OUT/machine.txt
    cp kernels/card_plans.json /tmp/card/card_plans_after.json; cp /tmp/card.log /tmp/card/ 2>/dev/null
    tar -czf $OUT/card.tgz -C /tmp/card --exclude=w .
  else
    PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu_probes timeout -k 5 150 python3 tools/gpu_probes/stage_kernels_probe.py \
      --blocks 4 --hidden 4096 --heads 32 --seq 4096 --microbatches 8 --top 25 > $B/stage-h4096.txt 2>&1
    echo "stage probe rc=$? at $SECONDS s" >> $B/stage-h4096.txt
  fi ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((560 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --gpt-single \
  --reps 3 --warmup 1 --out $B/gpt-eager > $B/gpt-eager.log 2>&1
echo "gpt-eager rc=$? at $SECONDS s" >> $B/gpt-eager.log
cp $B/profile.txt $B/stage-h4096.txt $OUT/ 2>/dev/null
{ for r in gpt-eager; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; tail -3 $B/gpt-eager.log; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
