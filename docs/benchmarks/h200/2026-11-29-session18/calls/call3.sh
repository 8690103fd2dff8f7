#!/usr/bin/env bash
# Device call 3 (one GPU): the stage probe with --kernels peerline (the kernels a captured iteration runs) at the shapes
# where call 2 ran torch's LayerNorm (eager auto below 64 MiB): 4 blocks, M=8, against compiled torch blocks.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for s in 1536:12:1024:4 1536:12:4096:1 2048:16:1024:2 2048:16:4096:1 3072:24:2048:1 3072:24:4096:1; do
  IFS=: read h nh sq mb <<< "$s"
  f=/tmp/stage-h${h}-s${sq}-mb${mb}.txt
  timeout -k 5 75 python3 tools/gpu_probes/stage_kernels_probe.py --blocks 4 --hidden $h --heads $nh --seq $sq \
    --micro-batch $mb --microbatches 8 --iters 3 --warmup 2 --top 12 --torch-compile --kernels peerline > $f 2>&1
  echo "h$h s$sq mb$mb rc=$? at $SECONDS s" >> $OUT/machine.txt
  { echo "=== hidden $h, heads $nh, seq $sq, micro-batch $mb"; grep -v Warning $f; } >> $OUT/stages.txt
done
cat $OUT/machine.txt
grep -E "^===|INFO (gemm|attention|other|copies|total) " $OUT/stages.txt
