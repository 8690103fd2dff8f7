#!/usr/bin/env bash
# Device call 1: pair A tests (master, sharded, schedules pp2), pair B benches (gpt pp2 recipes, pipeline zb-h1 order).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
( CUDA_VISIBLE_DEVICES=0,1 OUT=/tmp/a LIMIT=500 TESTS="tests/gpu/test_master_adamw_gpu.py tests/gpu/test_shard_optimizer_gpu.py tests/gpu/test_schedules_gpu.py" \
  bash tools/gpu_checks.sh -k "not schedules_gpu or test_pp2_matches or user_model" > /tmp/a.log 2>&1; cp /tmp/a/summary.txt $OUT/tests-A.txt; cp /tmp/a/logs.tgz $OUT/logs-A.tgz ) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  mkdir -p /tmp/b
  timeout -k 10 300 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
    --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master,compact --gpt-anchor-schedules 1f1b --gpt-anchor-compile off \
    --reps 3 --warmup 1 --out /tmp/b/gpt > /tmp/b/gpt.log 2>&1
  echo "gpt rc=$?" >> /tmp/b/gpt.log
  cp /tmp/b/gpt/results.md $OUT/gpt-pp2.md; tail -c 20000 /tmp/b/gpt.log > $OUT/gpt-pp2.log
  timeout -k 10 180 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute --schedules 1f1b,zb-h1 \
    --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-timeline --out /tmp/b/pipe > /tmp/b/pipe.log 2>&1
  echo "pipe rc=$?" >> /tmp/b/pipe.log
  cp /tmp/b/pipe/results.md $OUT/pipe-pp2.md; tail -c 8000 /tmp/b/pipe.log >> $OUT/gpt-pp2.log
  tar -czf $OUT/bench-B.tgz -C /tmp/b --exclude='*.pt' . 2>/dev/null
) &
wait
ls -la $OUT
