#!/usr/bin/env bash
# Device call 1 (2 x H100 asked). Phase 1 side by side: GPU 0 tools/kernels_card.sh (the H100 entry re-tuned with
# the one-pass residual add; kernel GPU tests, the eager fast path among them; hostcost); GPU 1 the kernels suite
# 1 MiB - 1 GiB, then the one-GPU eager profile (mid bf16, mid autocast, launch bf16).
# Phase 2 alone: the eager MLP suite (launch, mid, compute; pp=2 and one GPU).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0
  OUT=/tmp/card LIMIT=200 BENCH_LIMIT=90 timeout -k 5 330 bash tools/kernels_card.sh -v > /tmp/card.log 2>&1
  echo "kernels_card rc=$? at $SECONDS s" >> $OUT/machine.txt
  cp kernels/card_plans.json /tmp/card/card_plans_after.json; cp /tmp/card.log /tmp/card/ 2>/dev/null
  tar -czf $OUT/card.tgz -C /tmp/card --exclude=w . ) &
sleep 8
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 200 python3 -m peerline.bench.suites.kernels --sizes-mib 1,2,4,8,16,64,256,1024 --no-variants \
    --out $B/kernels > $B/kernels.log 2>&1
  echo "kernels rc=$? at $SECONDS s" >> $B/kernels.log
  for c in "mid bf16" "mid autocast" "launch bf16"; do set -- $c
    echo "=== $1 $2" >> $B/profile.txt
    PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu_probes timeout -k 5 90 python3 tools/gpu_probes/eager_single_profile.py \
      --config $1 --recipe $2 --top 30 >> $B/profile.txt 2>&1
    echo "profile rc=$? at $SECONDS s" >> $B/profile.txt
  done ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((555 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager > $B/eager.log 2>&1
echo "eager rc=$? at $SECONDS s" >> $B/eager.log
cp $B/profile.txt $OUT/ 2>/dev/null
{ for r in eager kernels; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
