#!/usr/bin/env bash
# Device call 5 (4 GPUs). The pp=4 GPU tests of zb-interleaved (MLP over the copy engine and NCCL, graph and eager;
# GPT), then the MLP pipeline at pp=4, M=8 (ZBV and ZB-H1 graphs, --precision bf16, against torch's 1F1B and ZBV with
# bf16 parameters) with the bubble-free time (the whole model on rank 0's GPU).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=/tmp/t4 LIMIT=230 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v \
  -k "zb_interleaved_pp4 or (zero_bubble_pp4 and zb-interleaved)" > /dev/null 2>&1
echo "tests done at $SECONDS s" >> $OUT/machine.txt
cp /tmp/t4/summary.txt $OUT/tests.txt 2>/dev/null
tar -xzf /tmp/t4/logs.tgz -C /tmp/t4 w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" /tmp/t4/w/pytest.log > $OUT/tests-lines.txt
left=$((560 - SECONDS))
timeout -k 10 $left torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
  --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
  --schedules zbv,zb-h1 --pipeline-precisions bf16 --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
{ cat $B/mlp-pp4/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/mlp-pp4.log | tail -n 5; } > $OUT/results.md
tail -n 40 $B/mlp-pp4.log > $OUT/mlp-pp4-log-tail.txt
cp $B/mlp-pp4/results.jsonl $OUT/mlp-pp4.jsonl 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
