#!/usr/bin/env bash
# Device call 8 (one GPU): the --zb-order one-GPU tests again after the review (the placed schedule gives the start-up line)
# (the MLP's and the GPT's, searched and paper).
set -u
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/tests LIMIT=300 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh -k "zbv_orders or zbv_stages2" > /dev/null 2>&1
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/tests/summary.txt $OUT/tests-summary.txt
grep -rh "zb-order" $B/tests/w/runs 2>/dev/null | sort -u | head -4 >> $OUT/machine.txt
cat $OUT/machine.txt; tail -n 12 $OUT/tests-summary.txt
