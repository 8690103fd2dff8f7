#!/usr/bin/env bash
# Device call 2 (2 x H200, the machine of call 1, warm): the GPU tests not reached before (out-of-memory line, tied
# embeddings, the gpt suite's records, chunked cross-entropy, the block timer's host lead); then, alone, the
# launch-bound GPT (32 x 256, M=16) against the plain torch GPT, graph and eager.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt
G=tests/gpu
OUT=/tmp/t LIMIT=330 TESTS="$G/test_reliability_gpu.py $G/test_gpt_gpu.py $G/test_cross_entropy_gpu.py $G/test_bench_gpu.py" \
  bash tools/gpu_checks.sh -v -k "out_of_memory or tied or suite_records or cross_entropy or time_blocks" > /dev/null 2>&1
cp /tmp/t/summary.txt $OUT/tests.txt; cp /tmp/t/logs.tgz $OUT/tests-logs.tgz
echo "tests done at $SECONDS s; other GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt
t0=$SECONDS
timeout -k 10 200 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs launch --gpt-variants torch,eager,graph \
  --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out /tmp/b/launch > /tmp/b-launch.log 2>&1
echo "gpt-launch rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-launch.md
cat /tmp/b/launch/results.md >> $OUT/gpt-launch.md 2>/dev/null
cp /tmp/b/launch/results.jsonl $OUT/gpt-launch.jsonl 2>/dev/null
grep -vE "^\s*$" /tmp/b-launch.log | tail -n 30 >> $OUT/gpt-launch.md
