#!/usr/bin/env bash
# Device call 2 (2 GPUs): the GPT at 8 x 4096 / seq 4096 pp=2 M=8, ZBV graph bf16 with searched, list and paper
# orders (ring form on the copy engine), against the plain torch GPT, compiled blocks, 1F1B with bf16 parameters.
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
timeout -k 10 420 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-layers 8 \
  --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 --gpt-variants torch,graph \
  --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --gpt-zb-orders searched,paper,list --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt; collect gpt
LEFT=$((560 - SECONDS))
if [ $LEFT -gt 60 ]; then
  OUT=$B/tests LIMIT=$LEFT TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh \
    -k "gpt_pp2 and zb-interleaved" > /dev/null 2>&1
  cp $B/tests/summary.txt $OUT/tests-summary.txt
fi
cat $OUT/machine.txt; cat $OUT/results.md; tail -n 20 $OUT/tests-summary.txt 2>/dev/null
