#!/usr/bin/env bash
# Device call 3 (2 GPUs): the copy-engine pp=2 tests that call 1's limit cut (interleaved with three stages per rank,
# the GPT's zbv / interleaved / paper-order / --zb-memory 1f1b cases).
mkdir -p $OUT && OUT=/tmp/b3 LIMIT=330 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -k "(interleaved_three and graph and not no-graph) or (gpt_pp2 and (zbv-copy-engine-graph or zbv-zb-order-paper or interleaved-graph or zbv-zb-memory))" > /dev/null 2>&1; cp /tmp/b3/summary.txt $OUT/tests-summary.txt; tail -n 30 $OUT/tests-summary.txt
