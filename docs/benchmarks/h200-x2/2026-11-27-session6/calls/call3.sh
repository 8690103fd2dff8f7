#!/usr/bin/env bash
# Device call 3 (2 x H200), alone: host time per call of --kernels auto's eager choices against torch's ops (launch
# and mid MLP shapes, one GPU); then the launch-bound GPT eager at pp=2, default attention route against cudnn-ops,
# alternated 3 times (median ms/iter of iterations 11-40).
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
{ CUDA_VISIBLE_DEVICES=0 timeout -k 5 60 python3 tools/gpu_probes/auto_host_probe.py --hidden 512 --tokens 512
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 60 python3 tools/gpu_probes/auto_host_probe.py --hidden 1024 --tokens 2048 --calls 500
} > $OUT/auto-host-probe.txt 2>&1
G="--model gpt --layers 32 --hidden 256 --heads 4 --seq 256 --micro-batch-size 2 -m 16 --precision bf16 --no-graph --iters 40"
for rep in 1 2 3; do for route in auto cudnn-ops; do
  PEERLINE_ATTENTION=$route timeout -k 10 60 torchrun --standalone --nproc_per_node=2 launch/pipeline.py $G > /tmp/g.log 2>&1
  echo "rep $rep $route rc=$? median ms/iter of iters 11-40: $(grep -oP '\| \K[0-9.]+(?= ms/iter)' /tmp/g.log | tail -30 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')" >> $OUT/gpt-route.txt
done; done
echo "done at $SECONDS s" >> $OUT/commit.txt
