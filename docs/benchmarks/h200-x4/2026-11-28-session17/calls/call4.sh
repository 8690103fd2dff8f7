#!/usr/bin/env bash
# Device call 4 (2 GPUs): the GPT's pp=2 GPU tests (against one GPU, every schedule and transport) that call 3's
# time limit cut.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name --format=csv,noheader; echo tree $(cat calls/TREE); } > $OUT/machine.txt
OUT=/tmp/b/tests LIMIT=300 TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -k "gpt_pp2" > /dev/null 2>&1
cp /tmp/b/tests/summary.txt $OUT/tests-summary.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt; grep -E "passed|failed|FAILED|ERROR|exit status" $OUT/tests-summary.txt | head -20
