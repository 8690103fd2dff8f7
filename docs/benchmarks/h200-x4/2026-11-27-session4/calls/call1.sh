#!/usr/bin/env bash
# Device call 1 (4 x H200). Phase A, in parallel: GPUs 0,1 the GPU tests of the new model-path kernels (RoPE,
# LayerNorm, compact/master AdamW, GPT); GPU 2 the stage-kernel probe; GPU 3 the kernels card (tune, kernel tests,
# hostcost). Phase B, alone on the machine: the GPT bench at pp=2 against the plain torch GPT.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> $OUT/commit.txt
G=tests/gpu
( CUDA_VISIBLE_DEVICES=0,1 OUT=/tmp/a LIMIT=300 TESTS="$G/test_rope_gpu.py $G/test_layer_norm_gpu.py $G/test_compact_adamw_gpu.py $G/test_master_adamw_gpu.py $G/test_gpt_gpu.py $G/test_cross_entropy_gpu.py" \
  bash tools/gpu_checks.sh -v -k "not grid and not zero_bubble" > /dev/null 2>&1; cp /tmp/a/summary.txt $OUT/tests-A.txt; cp /tmp/a/logs.tgz /tmp/logs-A.tgz ) &
( CUDA_VISIBLE_DEVICES=2 timeout -k 10 200 python3 tools/gpu_probes/stage_kernels_probe.py --device cuda > /tmp/probe.txt 2>&1
  echo "probe rc=$?" >> /tmp/probe.txt; cp /tmp/probe.txt $OUT/probe-stage-kernels.txt ) &
( CUDA_VISIBLE_DEVICES=3 OUT=/tmp/k LIMIT=200 BENCH_LIMIT=100 timeout -k 10 330 bash tools/kernels_card.sh > /tmp/kcard.log 2>&1
  echo "kernels_card rc=$?" >> /tmp/kcard.log; mkdir -p /tmp/kc; cp /tmp/k/* /tmp/kc/ 2>/dev/null; cp /tmp/kcard.log /tmp/kc/ ) &
wait
echo "phase A done at $SECONDS s" >> $OUT/commit.txt
B=/tmp/b; mkdir -p $B
t0=$SECONDS
timeout -k 10 240 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
  --gpt-anchor-compile off --reps 3 --warmup 1 --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master,compact \
  --gpt-anchor-schedules 1f1b --out $B/pp2 > $B/pp2.log 2>&1
echo "pp2 rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-pp2.md
cat $B/pp2/results.md >> $OUT/gpt-pp2.md 2>/dev/null
tar -czf $OUT/rest.tgz -C /tmp logs-A.tgz kc b --exclude='*.pt' 2>/dev/null
ls -la $OUT
