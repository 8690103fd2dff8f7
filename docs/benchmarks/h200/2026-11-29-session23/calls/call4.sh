#!/usr/bin/env bash
# Device call 4 (one GPU): tools/gpu_probes/pipeline_profile.py --gpt on the whole GPT 8 x 4096 / seq 4096 in one
# stage (1F1B, graphs, bf16): the probe's GPT path checked before a 2-GPU call, and the one-GPU busy time per iteration.
export PYTHONPATH=$PWD:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
timeout -k 5 200 python3 tools/gpu_probes/pipeline_profile.py --gpt 8x4096 --heads 32 --seq 4096 --micro-batch-size 1 \
  --microbatches 8 --schedule 1f1b --iters 2 --timed 6 --top 25 > $OUT/profile-gpt-1f1b-one-gpu.txt 2>&1
