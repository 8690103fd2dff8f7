#!/usr/bin/env bash
# Device call 1 (4 GPUs as two pairs). Pair 0,1: GPU tests of the last session's CPU-only changes (the eager auto
# block against float64, the pre-packed flag batches, the default model's pipeline runs), then the out-of-memory
# line test. Pair 2,3, alone on its GPUs: the eager MLP suite against the plain MLP anchor (every recipe; launch,
# mid, compute; the one-GPU part), then the eager GPT bench (compute and launch shapes, bf16).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/commit.txt
busy() { echo "GPU processes before $1 at $SECONDS s: $(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader | wc -l)" >> $OUT/commit.txt; }
(
  export CUDA_VISIBLE_DEVICES=0,1
  busy tests
  OUT=/tmp/t LIMIT=250 TESTS="tests/gpu/test_fused_linear_gpu.py tests/gpu/test_p2p_copy_engine.py tests/gpu/test_pipeline_gpu.py" \
    bash tools/gpu_checks.sh -v -k "test_fused_linear_gpu or test_p2p_copy_engine or default_bf16 or 1f1b-copy-engine-graph or no-graph-split or readme" > /dev/null 2>&1
  cp /tmp/t/summary.txt $OUT/tests.txt; cp /tmp/t/w/runs/failures.txt $OUT/tests-failures.txt 2>/dev/null
  busy oom
  OUT=/tmp/o LIMIT=$((545 - SECONDS)) TESTS=tests/gpu/test_reliability_gpu.py bash tools/gpu_checks.sh -v -k out_of_memory > /dev/null 2>&1
  cp /tmp/o/summary.txt $OUT/tests-oom.txt; cp /tmp/o/w/runs/failures.txt $OUT/tests-oom-failures.txt 2>/dev/null
  tar czf $OUT/oom-logs.tgz -C /tmp/o w 2>/dev/null
) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  busy eager
  t0=$SECONDS
  timeout -k 10 400 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py eager --reps 3 --warmup 1 \
    --out /tmp/b/eager > /tmp/b-eager.log 2>&1
  echo "eager rc=$? in $((SECONDS - t0)) s" > $OUT/eager.md
  cat /tmp/b/eager/results.md >> $OUT/eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/eager.jsonl 2>/dev/null
  grep -E "GOAL|ms/iter \(spread|one-GPU|error" /tmp/b-eager.log | tail -n 50 >> $OUT/eager.md
  busy gpt
  t0=$SECONDS
  timeout -k 10 $((560 - SECONDS)) torchrun --standalone --master-port 29612 --nproc_per_node=2 launch/bench.py gpt --gpt-configs launch,compute \
    --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out /tmp/b/gpt > /tmp/b-gpt.log 2>&1
  echo "gpt-eager rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-eager.md
  cat /tmp/b/gpt/results.md >> $OUT/gpt-eager.md 2>/dev/null; cp /tmp/b/gpt/results.jsonl $OUT/gpt-eager.jsonl 2>/dev/null
  grep -E "GOAL|error" /tmp/b-gpt.log | tail -n 20 >> $OUT/gpt-eager.md
) &
wait
echo "done at $SECONDS s" >> $OUT/commit.txt
