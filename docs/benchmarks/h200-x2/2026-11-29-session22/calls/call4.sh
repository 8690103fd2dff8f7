#!/usr/bin/env bash
# Device call 4 (2 GPUs), tree with zbv's paper order as the default: the copy-engine pp=2 tests that run zbv by
# default (now the paper order) and zb-interleaved with 4 stages per rank; then the MLP pipeline pp=2 M=8, ZBV and
# zb-interleaved graphs bf16 (default order and searched) against torch's 1F1B with bf16 parameters.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b4; mkdir -p $B
OUT=$B/tests LIMIT=200 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh \
  -k "(zb_interleaved_four and copy-engine) or (placed_pp2 and zbv and copy-engine and not no-graph) or (gpt_pp2 and zbv-copy-engine-graph)" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 200 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute \
  --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 4 \
  --warmup 1 --schedules zbv,zb-interleaved --pipeline-precisions bf16 --pipeline-zb-orders paper,searched \
  --no-pipeline-bubble-free --out $B/mlp > $B/mlp.log 2>&1
echo "mlp rc=$? at $SECONDS s" >> $OUT/machine.txt
cat $B/mlp/results.md > $OUT/results.md 2>/dev/null; grep -E "INFO|error" $B/mlp.log | tail -n 40 > $OUT/log-tails.txt
cp $B/mlp/results.jsonl $OUT/records.jsonl 2>/dev/null
cat $OUT/machine.txt; cat $OUT/results.md; tail -n 15 $OUT/tests-summary.txt
