#!/usr/bin/env bash
# Device call 2 (one GPU): call 1's stream-sharing part again (call 1's probe passed set_device a device without
# an index).
set -u
export PYTHONPATH=$PWD:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for s in 4096:4096:16384 4096:16384:4096 2048:2048:8192; do
  IFS=: read m k n <<< "$s"
  echo "=== m $m k $k n $n" >> $OUT/sharing.txt
  timeout -k 5 90 python3 tools/gpu_probes/stream_sharing_probe.py --m $m --k $k --n $n --reps 20 >> $OUT/sharing.txt 2>&1
  echo "sharing $s rc=$? at $SECONDS s" >> $OUT/machine.txt
done
cat $OUT/machine.txt $OUT/sharing.txt
