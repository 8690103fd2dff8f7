#!/usr/bin/env bash
# Device call 4 (2 GPUs), tree 442ee6f: the eager auto block against float64 with the bf16 Linear rule by
# multiply-adds (h2048 x 4096 rows fused); the GPT's eager rows at the compute shape, pp=2 and one GPU.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=/tmp/t1 LIMIT=80 TESTS="tests/gpu/test_fused_linear_gpu.py" bash tools/gpu_checks.sh -v -k "eager_auto_block_matches_float64" > /dev/null 2>&1
{ cat /tmp/t1/summary.txt; echo "##### lines"
  tar -xzf /tmp/t1/logs.tgz -C /tmp/t1 w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR|SKIPPED|Error" /tmp/t1/w/pytest.log | head -40; } > $OUT/tests.txt 2>&1
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 $((330 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --gpt-single \
  --reps 3 --warmup 1 --out $B/gpt-eager > $B/gpt-eager.log 2>&1
echo "gpt-eager rc=$? at $SECONDS s" >> $B/gpt-eager.log
{ cat $B/gpt-eager/results.md; tail -n 5 $B/gpt-eager.log; } > $OUT/results.md 2>&1
cp $B/gpt-eager/results.jsonl $OUT/gpt-eager.jsonl 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
