#!/usr/bin/env bash
# Device call 3 (2 x H200), every step alone: eager host cost after the LayerNorm / RoPE-attention changes. The
# stage probe at the compute and launch shapes; a profiled launch-bound eager GPT at pp=2 (host self time per op,
# rank 0 and 1); the eager GPT bench (compute, launch) against the plain torch GPT; then the out-of-memory test.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
busy() { echo "other GPU processes before $1: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l) at $SECONDS s" >> $OUT/commit.txt; }
busy probes
{ CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 python3 tools/gpu_probes/stage_kernels_probe.py --device cuda
  echo "probe compute rc=$?"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 90 python3 tools/gpu_probes/stage_kernels_probe.py --device cuda --blocks 16 \
    --hidden 256 --heads 4 --seq 256 --micro-batch 2 --microbatches 16
  echo "probe launch rc=$?"; } > $OUT/probes.txt 2>&1
busy profile
timeout -k 10 120 torchrun --standalone --nproc_per_node=2 launch/pipeline.py --model gpt --layers 32 --hidden 256 \
  --heads 4 --seq 256 --micro-batch-size 2 -m 16 --precision bf16 --iters 8 --profile /tmp/prof > /tmp/prof.log 2>&1
{ echo "profile rc=$?"; grep "iter " /tmp/prof.log | tail -4
  for r in 0 1; do python3 tools/gpu_probes/top_kernels.py /tmp/prof/rank$r --host --top 40; done
  python3 tools/gpu_probes/top_kernels.py /tmp/prof/rank0 --top 12; } > $OUT/profile-launch-eager.txt 2>&1
busy bench
t0=$SECONDS
timeout -k 10 200 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b \
  --reps 3 --warmup 1 --out /tmp/b/eager > /tmp/b-eager.log 2>&1
echo "gpt-eager rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-eager.md
cat /tmp/b/eager/results.md >> $OUT/gpt-eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/gpt-eager.jsonl 2>/dev/null
grep -vE "^\s*$|Warning|warn" /tmp/b-eager.log | tail -n 20 >> $OUT/gpt-eager.md
busy oom
OUT=/tmp/t LIMIT=200 TESTS="tests/gpu/test_reliability_gpu.py" bash tools/gpu_checks.sh -v -k "out_of_memory" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests-oom.txt; tar -czf $OUT/tests-oom-logs.tgz -C /tmp/t logs.tgz 2>/dev/null
echo "done at $SECONDS s" >> $OUT/commit.txt
