#!/usr/bin/env bash
# Device call 1 (4 GPUs as two pairs). Pair 0,1, alone on the disk: the checkpoint suite's training part at pp=2
# (GPT compute shape, about 10 GB per rank; sync save against --save-async; save and load GB/s per rank), one
# round. Pair 2,3: the optimizer suite (GPT compute shape, dp=2: DDP, DDP + ZeRO, peerline allreduce / sharded /
# overlapped gather), then the GPT block host-cost probe on one GPU, then the eager GPT bench (bf16, 1F1B anchor).
set -u
export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=index,name --format=csv,noheader; df -h /tmp /dev/shm; nproc; } > $OUT/machine.txt 2>&1
bench() {  # name port timeout args...
  local name=$1 port=$2 limit=$3; shift 3
  local t0=$SECONDS
  timeout -k 10 $limit torchrun --standalone --master-port $port --nproc_per_node=2 launch/bench.py "$@" \
    --out /tmp/b/$name > /tmp/b-$name.log 2>&1
  echo "$name rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" > $OUT/$name.md
  cat /tmp/b/$name/results.md >> $OUT/$name.md 2>/dev/null; cp /tmp/b/$name/results.jsonl $OUT/$name.jsonl 2>/dev/null
  grep -E "GOAL|RATIO|error|INFO checkpoint|Error" /tmp/b-$name.log | tail -n 40 >> $OUT/$name.md
}
( export CUDA_VISIBLE_DEVICES=0,1
  bench checkpoint 29611 555 checkpoint --checkpoint-dir /tmp/ck --reps 1
  rm -rf /tmp/ck ) &
( export CUDA_VISIBLE_DEVICES=2,3
  bench optimizer 29612 220 optimizer
  t0=$SECONDS
  CUDA_VISIBLE_DEVICES=2 timeout -k 5 90 python3 tools/gpu_probes/gpt_block_host_probe.py > $OUT/gpt-block-host-probe.txt 2>&1
  echo "probe rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" >> $OUT/gpt-block-host-probe.txt
  bench gpt-eager 29613 $((550 - SECONDS)) gpt --gpt-configs compute,launch --gpt-variants torch,eager \
    --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 ) &
wait
echo "done at $SECONDS s" >> $OUT/machine.txt
