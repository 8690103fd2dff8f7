#!/usr/bin/env bash
# Device call 3 (4 GPUs): scale-out (#32). Phase A side by side: 0,1 the two-GPU resharding tests; 2,3 alone on
# their GPUs, the checkpoint suite's training part at pp=2 (the GPT compute shape, about 1.3 B parameters; a
# synchronous save against --save-async). Phase B, all four GPUs: the sharded optimizer at pp=2 x dp=2 with zb-h1
# (sharded and overlapped gather), then the four-GPU resharding tests.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/commit.txt
df -h /tmp | tail -1 >> $OUT/commit.txt
keep() { cp $1/summary.txt $OUT/$2.txt; cp $1/w/runs/failures.txt $OUT/$2-failures.txt 2>/dev/null; }
(
  export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/a LIMIT=230 TESTS=tests/gpu/test_checkpoint_reshard_gpu.py bash tools/gpu_checks.sh -v -k two > /dev/null 2>&1
  keep /tmp/a tests-reshard-two
) &
(
  export CUDA_VISIBLE_DEVICES=2,3
  t0=$SECONDS
  timeout -k 10 230 torchrun --standalone --nproc_per_node=2 launch/bench.py checkpoint --checkpoint-dir /tmp/ck \
    --out /tmp/b/ckpt > /tmp/b-ckpt.log 2>&1
  echo "checkpoint rc=$? in $((SECONDS - t0)) s" > $OUT/checkpoint.md
  cat /tmp/b/ckpt/results.md >> $OUT/checkpoint.md 2>/dev/null; cp /tmp/b/ckpt/results.jsonl $OUT/checkpoint.jsonl 2>/dev/null
  grep -E "GOAL|error|GB/s|save|INFO" /tmp/b-ckpt.log | tail -n 40 >> $OUT/checkpoint.md
  rm -rf /tmp/ck
) &
wait
echo "phase A done at $SECONDS s" >> $OUT/commit.txt
OUT=/tmp/c LIMIT=$((585 - SECONDS)) TESTS="tests/gpu/test_shard_optimizer_gpu.py tests/gpu/test_checkpoint_reshard_gpu.py" \
  bash tools/gpu_checks.sh -v -k "(pp2_dp2 and zb) or four" > /dev/null 2>&1
keep /tmp/c tests-gpu4
echo "done at $SECONDS s" >> $OUT/commit.txt
