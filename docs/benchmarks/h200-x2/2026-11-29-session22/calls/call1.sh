#!/usr/bin/env bash
# Device call 1 (2 GPUs): the ring form of the placed schedules (receives posted just before their consumers) on the
# copy engine: the pp=2 copy-engine tests of zbv / interleaved / zb-interleaved (MLP and GPT), then the MLP pipeline
# pp=2 M=8 and M=16 ZBV graphs, list and searched orders, against torch's 1F1B with bf16 parameters.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; grep -E "INFO|GOAL|error|Error" $B/$1.log | tail -n 40; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/records.jsonl
}
OUT=$B/tests LIMIT=250 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh \
  -k "zbv_orders_pp2 or (placed_pp2 and copy-engine) or (zb_interleaved_four and copy-engine) or (interleaved_three and graph and not no-graph) or (gpt_pp2 and (zbv-copy-engine-graph or zbv-zb-order-paper or interleaved-graph))" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 280 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute,compute16 \
  --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 4 \
  --warmup 1 --schedules zbv --pipeline-precisions bf16 --pipeline-zb-orders list,searched,paper --out $B/mlp \
  > $B/mlp.log 2>&1
echo "mlp rc=$? at $SECONDS s" >> $OUT/machine.txt; collect mlp
cat $OUT/machine.txt; cat $OUT/results.md; tail -n 30 $OUT/tests-summary.txt
