#!/usr/bin/env bash
# Device call 3 (one GPU): the user-model tests (the new one-GPU --stages cases run here; the pp=2 and pp=4 cases are
# deselected on one GPU).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
OUT=$OUT/t LIMIT=240 TESTS="tests/gpu/test_schedules_gpu.py" bash tools/gpu_checks.sh -k user_model > /dev/null 2>&1
