#!/usr/bin/env bash
# Device call 4 (one GPU): the eager one-GPU cells (launch bf16 and autocast, mid bf16) with and without gc.freeze
# after set-up, and how many garbage collections of each generation ran while timed.
set -u
export PYTHONPATH=$PWD:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for cr in launch:bf16 mid:bf16 launch:autocast; do
  IFS=: read c r <<< "$cr"
  for f in "" --gc-freeze; do
    timeout -k 5 140 python3 tools/gpu_probes/eager_hooks_probe.py --config $c --recipe $r --timed 10 --reps 5 $f 2>&1 \
      | grep -v Warning >> $OUT/hooks-gc.txt
    echo "$c $r $f rc=$? at $SECONDS s" >> $OUT/machine.txt
  done
done
cat $OUT/machine.txt; grep INFO $OUT/hooks-gc.txt
