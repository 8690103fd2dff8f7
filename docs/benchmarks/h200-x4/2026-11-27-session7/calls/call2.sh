#!/usr/bin/env bash
# Device call 2 (4 GPUs): the GPU half of reliability (#31) on this tree. Phase A, two pairs side by side: 0,1 the
# out-of-memory line (after the watchdog's GIL-free beats), then preemption at pp=2; 2,3 the 2-GPU failure tests.
# Phase B, all four GPUs: kill and hang at pp=2 x dp=2 naming the rank, and preemption at pp=2 x dp=2.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/commit.txt
keep() { cp $1/summary.txt $OUT/$2.txt; cp $1/w/runs/failures.txt $OUT/$2-failures.txt 2>/dev/null; }
(
  export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/a LIMIT=240 TESTS=tests/gpu/test_reliability_gpu.py bash tools/gpu_checks.sh -v -k out_of_memory > /dev/null 2>&1
  keep /tmp/a tests-oom
  OUT=/tmp/a2 LIMIT=$((330 - SECONDS)) TESTS=tests/gpu/test_preempt_gpu.py bash tools/gpu_checks.sh -v > /dev/null 2>&1
  keep /tmp/a2 tests-preempt-pp2
) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  OUT=/tmp/b LIMIT=300 TESTS=tests/gpu/test_failures_gpu.py bash tools/gpu_checks.sh -v > /dev/null 2>&1
  keep /tmp/b tests-failures-pp2
) &
wait
echo "phase A done at $SECONDS s" >> $OUT/commit.txt
OUT=/tmp/c LIMIT=$((585 - SECONDS)) TESTS="tests/gpu/test_reliability_gpu.py tests/gpu/test_preempt_gpu.py" \
  bash tools/gpu_checks.sh -v -k "pp2_dp2_names or pp2dp2" > /dev/null 2>&1
keep /tmp/c tests-gpu4
echo "done at $SECONDS s" >> $OUT/commit.txt
