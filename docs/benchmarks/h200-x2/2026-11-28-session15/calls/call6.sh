#!/usr/bin/env bash
# Device call 6 (2 GPUs, asked as nvidia-h100-x2). The eager suite after the eager bf16 Linear rule: pp=2 at every
# shape (torch autocast / bf16 parameters against peerline autocast / bf16), then one GPU at every shape, alone.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # $1 finished so far into $OUT (the call may be cut); its JSON lines appended to $OUT/$1.jsonl
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 25 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$1.jsonl
}
timeout -k 10 180 torchrun --standalone --nproc_per_node=2 launch/bench.py eager --no-eager-single --reps 3 --warmup 1 \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 --out $B/eager-pp2 > $B/eager-pp2.log 2>&1
echo "eager-pp2 rc=$? at $SECONDS s" >> $B/eager-pp2.log
collect eager-pp2
left=$((455 - SECONDS))
CUDA_VISIBLE_DEVICES=0 timeout -k 10 $left torchrun --standalone --nproc_per_node=1 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager-one > $B/eager-one.log 2>&1
echo "eager-one rc=$? at $SECONDS s" >> $B/eager-one.log
collect eager-one
echo "done at $SECONDS s" >> $OUT/machine.txt
