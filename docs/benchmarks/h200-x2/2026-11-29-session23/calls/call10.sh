#!/usr/bin/env bash
# Device call 10 (2 GPUs, the budget's last minutes): the GPT 8 x 4096 / seq 4096 pp=2 M=8, ZBV graph bf16 (paper
# order, the default), with --precision bf16 now stepping through our AdamW kernel, against the plain torch GPT with
# compiled blocks, 1F1B with bf16 parameters, in the same run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
timeout -k 5 205 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-layers 8 \
  --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 --gpt-variants torch,graph \
  --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/gpt/results.md $OUT/results.md 2>/dev/null; cp $B/gpt/results.jsonl $OUT/records.jsonl 2>/dev/null
grep -E "INFO|GOAL|error|Error" $B/gpt.log | tail -n 40 > $OUT/log-tails.txt
cat $OUT/machine.txt $OUT/results.md 2>/dev/null | head -40; tail -n 12 $OUT/log-tails.txt
