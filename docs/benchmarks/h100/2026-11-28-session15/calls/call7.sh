#!/usr/bin/env bash
# Device call 7 (one H100). The eager suite's one-GPU part at every shape (peerline --stages 1 --no-graph against
# the plain torch loop, autocast and bf16), after the eager bf16 Linear rule.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
timeout -k 5 175 torchrun --standalone --nproc_per_node=1 launch/bench.py eager --reps 3 --warmup 1 \
  --out /tmp/eager-one > /tmp/eager-one.log 2>&1
echo "eager-one rc=$? at $SECONDS s" >> $OUT/machine.txt
cp /tmp/eager-one/results.md $OUT/results.md 2>/dev/null
cp /tmp/eager-one/results.jsonl $OUT/eager-one.jsonl 2>/dev/null
{ grep -E "GOAL|ratio|ms/iter" /tmp/eager-one.log | tail -n 30; tail -n 20 /tmp/eager-one.log; } > $OUT/log-tail.txt
