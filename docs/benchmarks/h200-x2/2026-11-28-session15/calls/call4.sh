#!/usr/bin/env bash
# Device call 4 (2 GPUs). Is the MLP pipeline's slower steady state (blocks of 20 iterations against single ones)
# the host feeding graph launches, or the GPUs' clocks at the power cap? ZBV --precision bf16 at pp=2, M=8: blocks
# of 1, then of 20, one launch per iteration; then --graph-loop 5 (5 iterations per launch); SM clock and power
# sampled every 100 ms throughout, each phase's start and end marked.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > $OUT/clocks.csv 2>&1 &
smi=$!
run() {  # $1 name, rest: probe flags
  name=$1; shift
  echo "phase $name start $(date +%H:%M:%S.%N)" >> $OUT/machine.txt
  timeout -k 10 120 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/block_length_probe.py --config compute \
    --schedule zbv --precision bf16 --no-anchor "$@" > /tmp/$name.txt 2>&1
  echo "phase $name rc=$? end $(date +%H:%M:%S.%N) at $SECONDS s" >> $OUT/machine.txt
  { echo "##### $name"; grep -E "^INFO|Error|error" /tmp/$name.txt | tail -n 8; } >> $OUT/blocks.txt
}
run single --blocks 1 --reps 20
run twenty --blocks 20 --reps 3
run loop5 --graph-loop 5 --blocks 5,20 --reps 3
kill $smi
