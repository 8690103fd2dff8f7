#!/usr/bin/env bash
# Device call 3 (2 GPUs): the embedding kernel's probe, its GPU tests with GPT bf16 cases, then the GPT 8 x 4096
# pp=2 ZBV bf16 against the compiled plain torch GPT's 1F1B (same run).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
(cd tools/gpu_probes && timeout -k 5 80 python3 embedding_probe.py) > $OUT/emb-probe.txt 2>&1
echo "probe rc=$? at $SECONDS s" >> $OUT/machine.txt
OUT=$OUT/t LIMIT=200 TESTS="tests/gpu/test_embedding_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh -k "embedding or bf16_graph_vs_eager or pure-bf16-1f1b-graph or pure-bf16-zb-h1-graph or zbv-copy-engine-graph or 1f1b-graph-tied"
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
B=/tmp/b; mkdir -p $B
timeout -k 5 215 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-layers 8 \
  --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-mbs 1 --gpt-microbatches 8 --gpt-variants torch,graph \
  --gpt-schedules zbv --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
cp $B/gpt/results.md $OUT/results.md 2>/dev/null; cp $B/gpt/results.jsonl $OUT/records.jsonl 2>/dev/null
grep -E "INFO|GOAL|error|Error" $B/gpt.log | tail -n 40 > $OUT/log-tails.txt
cat $OUT/machine.txt $OUT/emb-probe.txt $OUT/results.md 2>/dev/null | head -60; tail -n 8 $OUT/log-tails.txt; cat $OUT/t/summary.txt | tail -30
