#!/usr/bin/env bash
# Device call 1 (2 x H200): the cudnn-ops attention route's GPU tests; the stage probe at the launch-bound GPT shape,
# default route against PEERLINE_ATTENTION=cudnn-ops (host self time per op); then the eager MLP suite alone
# (launch, mid, compute; every variant, recipe-matched pairs; the one-GPU part per recipe).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
busy() { echo "other GPU processes before $1: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l) at $SECONDS s" >> $OUT/commit.txt; }
busy tests
OUT=/tmp/t LIMIT=110 TESTS="tests/gpu/test_rope_gpu.py" bash tools/gpu_checks.sh -v -k "fused_attention" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests-rope.txt; cp /tmp/t/failures.txt $OUT/tests-rope-failures.txt 2>/dev/null
busy probes
for route in auto cudnn-ops; do
  echo "=== PEERLINE_ATTENTION=$route"
  PEERLINE_ATTENTION=$route CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python3 tools/gpu_probes/stage_kernels_probe.py \
    --device cuda --blocks 16 --hidden 256 --heads 4 --seq 256 --micro-batch 2 --microbatches 16
  echo "probe $route rc=$?"
done > $OUT/probes.txt 2>&1
busy eager
t0=$SECONDS
timeout -k 10 $((570 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py eager --reps 3 --warmup 1 \
  --out /tmp/b/eager > /tmp/b-eager.log 2>&1
echo "eager rc=$? in $((SECONDS - t0)) s" > $OUT/eager.md
cat /tmp/b/eager/results.md >> $OUT/eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/eager.jsonl 2>/dev/null
grep -vE "^\s*$|Warning|warn" /tmp/b-eager.log | tail -n 60 >> $OUT/eager.md
echo "done at $SECONDS s" >> $OUT/commit.txt
