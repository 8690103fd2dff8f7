#!/usr/bin/env bash
# Device call 4 (2 GPUs), short: the GPT at 8 x 4096 / seq 4096 at pp=2, peerline ZBV with --zb-memory fast and 1f1b
# (the capped order planned with B longer than W, not yet timed on a GPU) against the plain torch GPT's compiled
# 1F1B, both recipes.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree 373a680; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
timeout -k 5 165 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
  --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-variants torch,graph \
  --gpt-schedules zbv --gpt-zb-memory fast,1f1b --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out $B/gpt-8x4096-pp2 > $B/gpt-8x4096-pp2.log 2>&1
echo "gpt-8x4096-pp2 rc=$? at $SECONDS s" >> $B/gpt-8x4096-pp2.log
cat $B/gpt-8x4096-pp2/results.md > $OUT/results.md 2>/dev/null; cp $B/gpt-8x4096-pp2/results.jsonl $OUT/gpt-8x4096-pp2.jsonl 2>/dev/null
tail -n 30 $B/gpt-8x4096-pp2.log > $OUT/log-tail.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
