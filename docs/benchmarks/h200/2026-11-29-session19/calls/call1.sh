#!/usr/bin/env bash
# Device call 1 (one GPU): how two compute streams share one GPU (eager and graph, three priority settings, three
# GEMM shapes), then the 8 x 4096 stage with its full kernel list (what "other" holds).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for s in 4096:4096:16384 4096:16384:4096 2048:2048:8192; do
  IFS=: read m k n <<< "$s"
  echo "=== m $m k $k n $n" >> $OUT/sharing.txt
  timeout -k 5 90 python3 tools/gpu_probes/stream_sharing_probe.py --m $m --k $k --n $n --reps 20 >> $OUT/sharing.txt 2>&1
  echo "sharing $s rc=$? at $SECONDS s" >> $OUT/machine.txt
done
timeout -k 5 150 python3 tools/gpu_probes/stage_kernels_probe.py --blocks 4 --hidden 4096 --heads 32 --seq 4096 \
  --micro-batch 1 --microbatches 8 --iters 4 --warmup 2 --top 45 --torch-compile --kernels peerline 2>&1 \
  | grep -v Warning > $OUT/stage-8x4096.txt
echo "stage rc=$? at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt $OUT/sharing.txt
grep -E "INFO (gemm|attention|other|copies|total) " $OUT/stage-8x4096.txt
