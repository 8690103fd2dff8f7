#!/usr/bin/env bash
# Device call 2 (4 GPUs). Phase 1 side by side: GPUs 0,1 the GPT zero-bubble / interleaved tests at pp=2 and the
# MLP schedule tests at pp=2 (split_backward's lean form on a GPU); GPUs 2,3 the GPT bench at pp=2, compute shape,
# peerline 1F1B / ZB-H1 / ZBV graphs (bf16) against the plain torch GPT's eager 1F1B: peak memory per rank.
# Phase 2, 4 GPUs: the same GPT bench at pp=4. Phase 3, 4 GPUs: the zero-bubble tests at pp=4 (GPT and MLP).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/p01 LIMIT=235 TESTS="tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py" bash tools/gpu_checks.sh -v \
    -k "(pp2_matches and (zb or zbv or interleaved)) or test_pp2_matches or placed_pp2 or user_model" > /dev/null 2>&1
  cp /tmp/p01/summary.txt $B/tests-pp2.txt; cp /tmp/p01/w/runs/failures.txt $B/tests-pp2-failures.txt 2>/dev/null
  echo "tests pp2 done at $SECONDS s" >> $OUT/machine.txt ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 235 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-variants torch,graph --gpt-schedules 1f1b,zb-h1,zbv --gpt-precisions bf16 --gpt-anchor-compile off \
    --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out $B/gpt-pp2 > $B/gpt-pp2.log 2>&1
  echo "gpt-pp2 rc=$? at $SECONDS s" >> $B/gpt-pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 150 torchrun --standalone --nproc_per_node=4 launch/bench.py gpt --gpt-configs compute \
  --gpt-variants torch,graph --gpt-schedules 1f1b,zb-h1,zbv --gpt-precisions bf16 --gpt-anchor-compile off \
  --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out $B/gpt-pp4 > $B/gpt-pp4.log 2>&1
echo "gpt-pp4 rc=$? at $SECONDS s" >> $B/gpt-pp4.log
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
OUT=/tmp/p4 LIMIT=$((550 - SECONDS)) TESTS="tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py" bash tools/gpu_checks.sh -v \
  -k "zero_bubble_pp4 or (test_pp4_matches and copy-engine and graph) or zbv_pp4" > /dev/null 2>&1
cp /tmp/p4/summary.txt $B/tests-pp4.txt; cp /tmp/p4/w/runs/failures.txt $B/tests-pp4-failures.txt 2>/dev/null
cp $B/tests-pp2.txt $B/tests-pp4.txt $OUT/ 2>/dev/null
{ for r in gpt-pp2 gpt-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "error|Error|GOAL" $B/$r.log | tail -n 20; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
