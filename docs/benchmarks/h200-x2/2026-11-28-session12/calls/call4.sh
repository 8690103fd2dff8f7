#!/usr/bin/env bash
# Device call 4 (2 GPUs, the budget's last minutes): the zbv --zb-memory 1f1b GPU tests on the order now planned
# with B longer than W (7d43d85): the MLP's placed zbv and the GPT's zbv at pp=2, copy engine, graphs.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name --format=csv,noheader; echo tree 864eb87; } > $OUT/machine.txt 2>&1
OUT=/tmp/t LIMIT=130 TESTS="tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py" \
  bash tools/gpu_checks.sh -v -k "(zb_memory and zbv) or zbv-zb-memory" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests.txt
tar -xzf /tmp/t/logs.tgz -C /tmp/t w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR" /tmp/t/w/pytest.log > $OUT/tests-lines.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
