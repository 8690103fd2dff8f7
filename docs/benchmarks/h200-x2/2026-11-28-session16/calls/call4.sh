#!/usr/bin/env bash
# Device call 4 (2 GPUs), the tree of call 3: the GPU tests call 3's time limit cut (the GPT on one GPU and at pp=2,
# the --zb-memory 1f1b orders).
set -u
B=/tmp/b; mkdir -p $B
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/machine.txt; echo tree $(cat calls/TREE) >> $OUT/machine.txt
OUT=$B/tests LIMIT=420 TESTS="tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py" \
  bash tools/gpu_checks.sh -k "gpt_one_gpu or gpt_pp2 or zb_memory_1f1b" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
