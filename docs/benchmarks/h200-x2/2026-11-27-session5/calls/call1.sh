#!/usr/bin/env bash
# Device call 1 (2 x H200), every step alone on the machine: the stage probe (eager wall and host rows, one GPU),
# then the GPT bench at pp=2 at two other shapes (hidden 1536 seq 1024; 8 x 4096 seq 4096) against the plain torch
# GPT, its blocks eager and compiled.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/commit.txt
gpus_busy() { echo "other GPU processes before $1: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt; }
gpus_busy probe
CUDA_VISIBLE_DEVICES=0 timeout -k 10 150 python3 tools/gpu_probes/stage_kernels_probe.py --device cuda > $OUT/probe-stage-kernels.txt 2>&1
echo "probe rc=$? at $SECONDS s" >> $OUT/commit.txt
mkdir -p /tmp/b
shape() {  # name, timeout, gpt flags...
  local name=$1 limit=$2; shift 2; gpus_busy $name; local t0=$SECONDS
  timeout -k 10 $limit torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
    --gpt-anchor-compile both --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16 --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 "$@" --out /tmp/b/$name > /tmp/b/$name.log 2>&1
  echo "$name rc=$? in $((SECONDS - t0)) s" > $OUT/gpt-$name.md
  cat /tmp/b/$name/results.md >> $OUT/gpt-$name.md 2>/dev/null
  cp /tmp/b/$name/results.jsonl $OUT/gpt-$name.jsonl 2>/dev/null
  grep -vE "^\s*$" /tmp/b/$name.log | tail -n 30 >> $OUT/gpt-$name.md
}
shape pp2-h1536-s1024 200 --gpt-layers 24 --gpt-hidden 1536 --gpt-heads 12 --gpt-seq 1024
shape pp2-h4096-s4096 200 --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096
echo "done at $SECONDS s" >> $OUT/commit.txt
