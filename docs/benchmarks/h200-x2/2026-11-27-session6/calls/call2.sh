#!/usr/bin/env bash
# Device call 2 (2 x H200), every run alone: where eager --kernels auto loses to --kernels torch on the MLP (mid
# shape, pp=2): profiled runs of master/auto, master/torch and autocast/auto (device kernels and host self time per
# op, rank 0); then the launch-bound GPT eager at pp=2 with the default attention route against cudnn-ops (ms/iter of
# iterations 6-30, alternated twice).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
MID="--layers 24 --hidden 1024 --micro-batch-size 4 --seq 512 -m 12 --no-graph"
for v in "master auto" "master torch" "autocast auto" "autocast torch"; do
  set -- $v
  echo "other GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l) at $SECONDS s" >> $OUT/commit.txt
  timeout -k 10 75 torchrun --standalone --nproc_per_node=2 launch/pipeline.py $MID --precision $1 --kernels $2 \
    --iters 8 --profile /tmp/p-$1-$2 > /tmp/p-$1-$2.log 2>&1
  { echo "=== mid eager --precision $1 --kernels $2 rc=$?"; grep "iter " /tmp/p-$1-$2.log | tail -3
    python3 tools/gpu_probes/top_kernels.py /tmp/p-$1-$2/rank0 --top 14
    python3 tools/gpu_probes/top_kernels.py /tmp/p-$1-$2/rank0 --host --top 30; } >> $OUT/profile-mid.txt 2>&1
done
G="--model gpt --layers 32 --hidden 256 --heads 4 --seq 256 --micro-batch-size 2 -m 16 --precision bf16 --no-graph --iters 30"
for rep in 1 2; do for route in auto cudnn-ops; do
  PEERLINE_ATTENTION=$route timeout -k 10 60 torchrun --standalone --nproc_per_node=2 launch/pipeline.py $G > /tmp/g.log 2>&1
  echo "rep $rep $route rc=$? median ms/iter of iters 6-30: $(grep -oP '\| \K[0-9.]+(?= ms/iter)' /tmp/g.log | tail -25 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')" >> $OUT/gpt-route.txt
done; done
echo "done at $SECONDS s" >> $OUT/commit.txt
