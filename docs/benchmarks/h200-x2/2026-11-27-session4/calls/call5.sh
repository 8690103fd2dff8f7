#!/usr/bin/env bash
# Device calls 5 and 6 (the same warm 2 x H200 machine as call 4), alone: the eager anchor beside peerline's 1F1B,
# then beside zb-h1 (bf16, compact). Each ran as one command line through the device tool.
export PYTHONPATH=$PWD
timeout -k 10 150 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
  --gpt-anchor-compile off --gpt-schedules 1f1b --gpt-precisions bf16 --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out /tmp/b/e
timeout -k 5 110 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-variants torch,graph \
  --gpt-anchor-compile off --gpt-schedules zb-h1 --gpt-precisions bf16,compact --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out /tmp/b/z
