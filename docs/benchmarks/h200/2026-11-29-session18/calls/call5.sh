#!/usr/bin/env bash
# Device call 5 (one GPU): the gpt suite with --gpt-paired (its first GPU run) at pp=1: the 8 x 4096 / seq 4096 GPT
# on one GPU, the plain torch GPT's compiled 1F1B with bf16 parameters against peerline's graph with --precision bf16,
# each peerline variant timed in turn with the anchor built again beside it (the record keeps the search's time).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
timeout -k 10 480 torchrun --standalone --nproc_per_node=1 launch/bench.py gpt --gpt-configs compute \
  --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 \
  --gpt-variants torch,graph --gpt-schedules 1f1b --gpt-precisions bf16 --gpt-anchor-compile on \
  --gpt-anchor-schedules 1f1b --reps 4 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/gpt/results.md $OUT/gpt-results.md 2>/dev/null; cp $B/gpt/results.jsonl $OUT/gpt-results.jsonl 2>/dev/null
grep -E "INFO|GOAL|error|Error" $B/gpt.log | tail -n 40 > $OUT/gpt-log-tail.txt
cat $OUT/machine.txt; cat $OUT/gpt-log-tail.txt
