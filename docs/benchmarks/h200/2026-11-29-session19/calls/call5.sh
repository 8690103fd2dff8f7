#!/usr/bin/env bash
# Device call 5 (one GPU): the one-GPU schedule and pipeline tests, with the new --zb-order ones (zbv's two stages as
# streams of the device, searched and paper orders, captured, against zb-h1).
set -u
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/tests LIMIT=420 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_pipeline_gpu.py" \
  bash tools/gpu_checks.sh -k "one_gpu" > /dev/null 2>&1
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/tests/summary.txt $OUT/tests-summary.txt
cat $OUT/machine.txt; tail -n 30 $OUT/tests-summary.txt
