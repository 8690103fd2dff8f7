#!/usr/bin/env bash
# Device call 6 (one GPU): the GPT's new --zb-order one-GPU tests (zbv's two stages as streams, searched and paper,
# captured, fp32, against 1F1B) and the GPT's other one-GPU zero-bubble check.
set -u
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/tests LIMIT=300 TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -k "gpt_one_gpu and (zbv or zb_h1)" > /dev/null 2>&1
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/tests/summary.txt $OUT/tests-summary.txt
cat $OUT/machine.txt; tail -n 20 $OUT/tests-summary.txt
