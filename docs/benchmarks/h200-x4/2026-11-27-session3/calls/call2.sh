#!/usr/bin/env bash
# Device call 2: GPT benches, each alone on the machine (an eager anchor is slowed by other jobs' CPU load).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> $OUT/commit.txt
B=/tmp/b; mkdir -p $B
gpt() {  # name nproc limit args...
  local name=$1 np=$2 lim=$3; shift 3
  local t0=$SECONDS
  timeout -k 10 $lim torchrun --standalone --nproc_per_node=$np launch/bench.py gpt --gpt-variants torch,graph \
    --gpt-anchor-compile off --reps 3 --warmup 1 --out $B/$name "$@" > $B/$name.log 2>&1
  echo "$name rc=$? in $((SECONDS - t0)) s" >> $OUT/gpt.md
  cat $B/$name/results.md >> $OUT/gpt.md 2>/dev/null
}
gpt pp2-compute 2 200 --gpt-configs compute --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master,compact --gpt-anchor-schedules 1f1b,gpipe
gpt pp4-compute 4 170 --gpt-configs compute --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master --gpt-anchor-schedules 1f1b,gpipe
gpt pp2-h4096-s4096 2 130 --gpt-configs compute --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 \
  --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master --gpt-anchor-schedules 1f1b
for f in $B/*.log; do echo "== $f"; grep -vE "^\s*$" $f | tail -n 25; done > $OUT/gpt-logs.txt 2>&1
tar -czf $OUT/gpt.tgz -C $B . 2>/dev/null
