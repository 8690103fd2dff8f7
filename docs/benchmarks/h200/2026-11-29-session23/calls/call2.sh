#!/usr/bin/env bash
# Device call 2 (one GPU, the machine of call 1 still warm): the GPT one-GPU tests that call 1's limit cut.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
OUT=$OUT/t2 LIMIT=300 TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh > /dev/null 2>&1
cp $OUT/t2/summary.txt $OUT/tests2-summary.txt
