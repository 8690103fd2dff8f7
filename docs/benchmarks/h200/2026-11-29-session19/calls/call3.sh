#!/usr/bin/env bash
# Device call 3 (one GPU): what the failsafe hooks cost the host-bound eager one-GPU cells (launch, mid; bf16,
# autocast): plain torch, peerline as the eager suite runs it, peerline without the failsafe.
set -u
export PYTHONPATH=$PWD:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for c in launch mid; do for r in bf16 autocast; do
  timeout -k 5 150 python3 tools/gpu_probes/eager_hooks_probe.py --config $c --recipe $r --timed 10 --reps 5 2>&1 \
    | grep -v Warning >> $OUT/hooks.txt
  echo "$c $r rc=$? at $SECONDS s" >> $OUT/machine.txt
done; done
cat $OUT/machine.txt; grep INFO $OUT/hooks.txt
