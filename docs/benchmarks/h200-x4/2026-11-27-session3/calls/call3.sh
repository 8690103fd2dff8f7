#!/usr/bin/env bash
# Device call 3: 4-GPU tests, then loss curves (pair A) beside 2-GPU tests (pair B).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt
G=tests/gpu
OUT=/tmp/t4 LIMIT=290 TESTS="$G/test_reliability_gpu.py::test_pp2_dp2_names_the_rank_that_stopped[hang:rank=1:iter=6] \
$G/test_gpt_gpu.py::test_gpt_zero_bubble_pp4_matches_one_gpu $G/test_shard_optimizer_gpu.py::test_pp2_dp2_sharded_equals_unsharded[zb-h1] \
$G/test_shard_optimizer_gpu.py::test_dp4_sharded_equals_unsharded $G/test_schedules_gpu.py::test_pp4_matches_one_gpu_bitwise[zb-h1-copy-engine---graph] \
$G/test_schedules_gpu.py::test_user_model_schedules_match_one_gpu[zb-h1-pp4]" bash tools/gpu_checks.sh -v > /dev/null 2>&1
cp /tmp/t4/summary.txt $OUT/tests-gpu4.txt; cp /tmp/t4/logs.tgz $OUT/logs-gpu4.tgz
(
  export CUDA_VISIBLE_DEVICES=0,1; mkdir -p /tmp/L
  for r in master bf16 compact; do
    timeout -k 5 85 torchrun --standalone --nproc_per_node=2 launch/pipeline.py --model gpt --layers 24 --hidden 2048 --heads 16 \
      --seq 2048 --micro-batch-size 1 --microbatches 8 --iters 200 --log-every 1 --precision $r --metrics-jsonl /tmp/L/$r.jsonl > /tmp/L/$r.log 2>&1
    echo "$r rc=$?" >> /tmp/L/rc.txt
  done
  tar -czf $OUT/losses.tgz -C /tmp/L .
) &
(
  OUT=/tmp/t2 CUDA_VISIBLE_DEVICES=2,3 LIMIT=230 TESTS="$G/test_schedules_gpu.py::test_user_model_schedules_match_one_gpu[interleaved-pp2] \
$G/test_schedules_gpu.py::test_user_model_schedules_match_one_gpu[zbv-pp2] $G/test_rope_gpu.py::test_fused_attention_matches_unfused" \
  bash tools/gpu_checks.sh -v > /dev/null 2>&1
  cp /tmp/t2/summary.txt $OUT/tests-pair.txt; cp /tmp/t2/logs.tgz $OUT/logs-pair.tgz
) &
wait
