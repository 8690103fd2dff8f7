#!/usr/bin/env bash
# Device call 5 (4 GPUs), tree with zbv's paper order as the default and the ring form: the copy-engine pp=4 tests of
# the placed schedules (MLP zbv, zb-interleaved, interleaved; the GPT's zbv and zb-interleaved); the MLP pipeline
# pp=4 M=8, ZBV and zb-interleaved graphs bf16 (default order and searched) against torch's 1F1B with bf16
# parameters, with the bubble-free time; then, in the time left, the GPT 8 x 4096 / seq 4096 at pp=4, ZBV paper.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b5; mkdir -p $B
OUT=$B/tests LIMIT=150 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh \
  -k "(zbv_pp4 and copy-engine) or (zb_interleaved_pp4 and copy-engine) or (test_pp4_matches and interleaved-copy-engine---graph) or (zero_bubble_pp4 and (zbv or zb-interleaved))" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 200 torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
  --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 4 \
  --warmup 1 --schedules zbv,zb-interleaved --pipeline-precisions bf16 --pipeline-zb-orders paper,searched \
  --out $B/mlp > $B/mlp.log 2>&1
echo "mlp rc=$? at $SECONDS s" >> $OUT/machine.txt
{ echo "=== mlp"; cat $B/mlp/results.md; } > $OUT/results.md 2>/dev/null; grep -E "INFO|error" $B/mlp.log | tail -n 40 > $OUT/log-tails.txt
cat $B/mlp/results.jsonl > $OUT/records.jsonl 2>/dev/null
LEFT=$((545 - SECONDS))
if [ $LEFT -gt 90 ]; then
  timeout -k 5 $LEFT torchrun --standalone --nproc_per_node=4 launch/bench.py gpt --gpt-configs compute --gpt-layers 8 \
    --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 --gpt-variants torch,graph \
    --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
  echo "gpt rc=$? (limit $LEFT) at $SECONDS s" >> $OUT/machine.txt
  { echo "=== gpt"; cat $B/gpt/results.md; } >> $OUT/results.md 2>/dev/null; grep -E "INFO|error" $B/gpt.log | tail -n 30 >> $OUT/log-tails.txt
  cat $B/gpt/results.jsonl >> $OUT/records.jsonl 2>/dev/null
fi
cat $OUT/machine.txt; cat $OUT/results.md; tail -n 15 $OUT/tests-summary.txt
