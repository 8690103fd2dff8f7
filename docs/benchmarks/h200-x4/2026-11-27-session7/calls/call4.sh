#!/usr/bin/env bash
# Device call 4 (4 GPUs, the session's last ~5 minutes): the two scale-out benches built or fixed this session, side
# by side on separate GPU pairs (labelled so in the records; each bench's ratios are within itself). 0,1: the
# optimizer suite at pp=1 x dp=2 on the GPT compute shape (DDP, DDP + ZeRO, peerline allreduce / sharded / overlap).
# 2,3: the checkpoint suite's training part at pp=2 (sync save against --save-async).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/commit.txt
run_bench() {  # pair name suite args...
  local pair=$1 name=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$pair
    t0=$SECONDS
    timeout -k 5 225 torchrun --standalone --nproc_per_node=2 launch/bench.py "$@" --out /tmp/b/$name > /tmp/b-$name.log 2>&1
    echo "$name rc=$? in $((SECONDS - t0)) s" > $OUT/$name.md
    cat /tmp/b/$name/results.md >> $OUT/$name.md 2>/dev/null; cp /tmp/b/$name/results.jsonl $OUT/$name.jsonl 2>/dev/null
    grep -E "GOAL|RATIO|error|INFO" /tmp/b-$name.log | tail -n 40 >> $OUT/$name.md ) &
}
run_bench 0,1 optimizer optimizer
run_bench 2,3 checkpoint checkpoint --checkpoint-dir /tmp/ck
wait
rm -rf /tmp/ck
echo "done at $SECONDS s" >> $OUT/commit.txt
