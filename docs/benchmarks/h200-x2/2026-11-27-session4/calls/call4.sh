#!/usr/bin/env bash
# Device call 4 (2 x H200), alone on the machine: the GPT bench at pp=2 with the anchor's blocks torch.compile'd
# (what torchtitan runs), against peerline's graphs in the same run.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; nvidia-smi --query-gpu=name,memory.total --format=csv >> $OUT/commit.txt
echo "other GPU processes before: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt
t0=$SECONDS
timeout -k 10 215 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
  --gpt-anchor-compile on --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16 --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out /tmp/b/c > /tmp/b.log 2>&1
echo "gpt-pp2-compiled-anchor rc=$? in $((SECONDS - t0)) s" > $OUT/bench.md
cat /tmp/b/c/results.md >> $OUT/bench.md 2>/dev/null
cp /tmp/b/c/results.jsonl $OUT/ 2>/dev/null
grep -vE "^\s*$" /tmp/b.log | tail -n 40 > $OUT/bench-log.txt
