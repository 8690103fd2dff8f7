#!/usr/bin/env bash
# Device call 4 (2 x H200): the eager GPT bench (compute, launch; bf16) alone after the eager Linear rule, then the
# GPT tests that run the changed eager paths (bf16 graph vs eager, pure bf16, zb-h1 eager at pp=2).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt
echo "other GPU processes before bench: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt
t0=$SECONDS
timeout -k 10 170 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out /tmp/b/eager > /tmp/b-eager.log 2>&1
echo "gpt-eager rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-eager.md
cat /tmp/b/eager/results.md >> $OUT/gpt-eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/gpt-eager.jsonl 2>/dev/null
grep -vE "^\s*$|Warning|warn" /tmp/b-eager.log | tail -n 12 >> $OUT/gpt-eager.md
OUT=/tmp/t LIMIT=230 TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v -k "bf16_graph_vs_eager or pure_bf16 or zb-h1-nccl-no-graph or 1f1b-copy-engine-no-graph or pure-bf16-zb-h1" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests-gpt-eager.txt; cp /tmp/t/logs.tgz $OUT/tests-gpt-eager-logs.tgz
echo "done at $SECONDS s" >> $OUT/commit.txt
