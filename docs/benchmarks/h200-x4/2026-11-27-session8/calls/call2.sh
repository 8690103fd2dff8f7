#!/usr/bin/env bash
# Device call 2 (4 GPUs). First, alone on the host: the GPT block host-cost probe on GPU 0 (launch shape, with the
# profiler's host op table). Then pair 2,3: the eager MLP suite (every recipe; launch, mid, compute; one GPU), with
# only the residual-add kernel probe beside it on GPU 0 (graph-replayed device time, one core).
set -u
export PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=index,name --format=csv,noheader; git log --oneline -1 2>/dev/null; } > $OUT/machine.txt 2>&1
t0=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout -k 5 100 python3 tools/gpu_probes/gpt_block_host_probe.py --profile > $OUT/gpt-block-host-probe.txt 2>&1
echo "probe rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" >> $OUT/gpt-block-host-probe.txt
( export CUDA_VISIBLE_DEVICES=2,3
  t0=$SECONDS
  timeout -k 10 $((555 - SECONDS)) torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py eager \
    --reps 3 --warmup 1 --out /tmp/b/eager > /tmp/b-eager.log 2>&1
  echo "eager rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" > $OUT/eager.md
  cat /tmp/b/eager/results.md >> $OUT/eager.md 2>/dev/null; cp /tmp/b/eager/results.jsonl $OUT/eager.jsonl 2>/dev/null
  grep -E "GOAL|ms/iter \(spread|one-GPU|error|Error" /tmp/b-eager.log | tail -n 60 >> $OUT/eager.md ) &
( export CUDA_VISIBLE_DEVICES=0
  t0=$SECONDS
  timeout -k 5 200 python3 tools/gpu_probes/residual_add_probe.py --json $OUT/residual_add_probe.json > $OUT/residual-add-probe.txt 2>&1
  echo "residual probe rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" >> $OUT/residual-add-probe.txt ) &
wait
echo "done at $SECONDS s" >> $OUT/machine.txt
