#!/usr/bin/env bash
# Device call 4 (2 x H200): after the eager capture-query cut and auto's direct cuDNN route. GPU tests of the
# changed paths (fused attention; GPT graph vs eager, pp=2 copy engine eager and graph), then the eager MLP suite
# alone (launch, mid; the recipe-matched variants and --kernels torch; the one-GPU part), then, if time is left,
# the eager GPT bench at the launch-bound shape.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
busy() { echo "other GPU processes before $1: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l) at $SECONDS s" >> $OUT/commit.txt; }
busy tests
OUT=/tmp/t LIMIT=110 TESTS="tests/gpu/test_rope_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v -k \
  "fused_attention or bf16_graph_vs_eager or 1f1b-copy-engine-graph or 1f1b-copy-engine-no-graph" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests.txt; cp /tmp/t/failures.txt $OUT/tests-failures.txt 2>/dev/null
busy eager
t0=$SECONDS
timeout -k 10 $((400 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py eager --eager-configs launch,mid \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16,peerline-torch-kernels --reps 3 --warmup 1 \
  --out /tmp/b/eager > /tmp/b-eager.log 2>&1
echo "eager rc=$? in $((SECONDS - t0)) s" > $OUT/eager.md
cat /tmp/b/eager/results.md >> $OUT/eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/eager.jsonl 2>/dev/null
grep -E "GOAL|ms/iter \(spread|one-GPU" /tmp/b-eager.log | tail -n 40 >> $OUT/eager.md
if [ $SECONDS -lt 390 ]; then
  busy gpt
  t0=$SECONDS
  timeout -k 10 $((470 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs launch \
    --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out /tmp/b/gpt > /tmp/b-gpt.log 2>&1
  echo "gpt-eager rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-eager.md
  cat /tmp/b/gpt/results.md >> $OUT/gpt-eager.md 2>/dev/null; cp /tmp/b/gpt/results.jsonl $OUT/gpt-eager.jsonl 2>/dev/null
fi
echo "done at $SECONDS s" >> $OUT/commit.txt
