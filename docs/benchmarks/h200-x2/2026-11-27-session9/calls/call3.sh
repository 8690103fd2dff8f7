#!/usr/bin/env bash
# Device call 3 (2 x H100). Phase 1 side by side: GPU 0 tools/kernels_card.sh (the H100 entry re-tuned with pl_flat,
# kernel GPU tests, hostcost); GPU 1 the kernels suite 1 MiB - 1 GiB, then the GPT block host probe --rope-parts.
# Phase 2 alone: the eager GPT bench at pp=2 (launch, compute) against the plain torch GPT's eager 1F1B.
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
  timeout -k 5 100 python3 tools/gpu_probes/gpt_block_host_probe.py --rope-parts > $B/probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $B/probe.txt ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((520 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 \
  --out $B/gpt-eager > $B/gpt-eager.log 2>&1
echo "gpt-eager rc=$? at $SECONDS s" >> $B/gpt-eager.log
cp $B/probe.txt $OUT/ 2>/dev/null
{ for r in gpt-eager kernels; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
