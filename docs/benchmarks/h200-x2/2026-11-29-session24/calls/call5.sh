#!/usr/bin/env bash
# Device call 5 (2 GPUs, the budget's last minutes): small memset nodes as kernel nodes: their GPU tests and two GPT
# graph tests, then the GPT 8 x 4096 pp=2 ZBV bf16 against the compiled plain torch GPT's 1F1B (same run).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
OUT=$OUT/t LIMIT=80 TESTS="tests/gpu/test_graph_memsets_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh -k "memset or pure_bf16_graph_vs_eager or zbv-copy-engine-graph"
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
B=/tmp/b; mkdir -p $B
timeout -k 5 $((228 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-layers 8 \
  --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 --gpt-variants torch,graph \
  --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/gpt/results.md $OUT/results.md 2>/dev/null; cp $B/gpt/results.jsonl $OUT/records.jsonl 2>/dev/null
grep -E "INFO|GOAL|error|Error|memset|eager" $B/gpt.log | tail -n 40 > $OUT/log-tails.txt
cat $OUT/machine.txt $OUT/results.md 2>/dev/null | head -30; tail -n 6 $OUT/log-tails.txt; cat $OUT/t/summary.txt | tail -25
