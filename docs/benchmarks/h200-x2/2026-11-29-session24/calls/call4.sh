#!/usr/bin/env bash
# Device call 4 (2 GPUs): the GPT 8 x 4096 pp=2 ZBV profile after the fused cross-entropy and embedding kernels
# (call 1 is before), then the gpt suite's compute shape (24 x 2048, seq 2048, M=8) against the compiled plain torch
# GPT's 1F1B in the same run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
timeout -k 5 120 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py --gpt 8x4096 --heads 32 \
  --seq 4096 --micro-batch-size 1 --microbatches 8 --schedule zbv --iters 2 --timed 6 --top 25 > $OUT/profile.txt 2>&1
echo "profile rc=$? at $SECONDS s" >> $OUT/machine.txt
B=/tmp/b; mkdir -p $B
timeout -k 5 $((400 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
  --gpt-variants torch,graph --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/gpt/results.md $OUT/results.md 2>/dev/null; cp $B/gpt/results.jsonl $OUT/records.jsonl 2>/dev/null
grep -E "INFO|GOAL|error|Error" $B/gpt.log | tail -n 40 > $OUT/log-tails.txt
cat $OUT/machine.txt $OUT/results.md 2>/dev/null | head -40; grep -E "wall|class" $OUT/profile.txt | head -14; tail -n 6 $OUT/log-tails.txt
