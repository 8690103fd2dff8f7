#!/usr/bin/env bash
# Device call 2 (2 GPUs). The MLP compute shape's captured iteration profiled per rank: pp=2 ZBV --precision bf16,
# then the whole model on one GPU (pp=1, 1F1B: the bubble-free time); the eager suite, every shape, pp=2 and one GPU,
# with the eager Linear rule of 1bcb85f (the one-GPU part on GPU 1 beside the one-GPU probe on GPU 0).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; git log -1 --format=%h 2>/dev/null; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # $1 finished so far into $OUT (the call may be cut); its JSON lines appended to $OUT/$2.jsonl
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 25 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
timeout -k 10 120 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py --config compute \
  --schedule zbv --precision bf16 > $OUT/probe-pp2.txt 2>&1
echo "probe pp2 rc=$? at $SECONDS s" >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 python3 tools/gpu_probes/pipeline_profile.py --config compute \
  --schedule 1f1b --precision bf16 > $OUT/probe-pp1.txt 2>&1 &
p1=$!
(CUDA_VISIBLE_DEVICES=1 timeout -k 10 230 torchrun --standalone --nproc_per_node=1 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager-one > $B/eager-one.log 2>&1; echo "eager-one rc=$? at $SECONDS s" >> $B/eager-one.log) &
p2=$!
wait $p1; echo "probe pp1 rc=$? at $SECONDS s" >> $OUT/machine.txt
wait $p2; collect eager-one eager-one
echo "eager one done at $SECONDS s" >> $OUT/machine.txt
left=$((565 - SECONDS))
timeout -k 10 $left torchrun --standalone --nproc_per_node=2 launch/bench.py eager --no-eager-single --reps 3 --warmup 1 \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 \
  --out $B/eager-pp2 > $B/eager-pp2.log 2>&1
echo "eager-pp2 rc=$? at $SECONDS s" >> $B/eager-pp2.log
collect eager-pp2 eager-pp2
echo "done at $SECONDS s" >> $OUT/machine.txt
