#!/usr/bin/env bash
# Device call 5 (one GPU): the AdamW step over one GPT rank's bf16 parameters (4 blocks of 4096 and an embedding:
# pp=2; then 8 blocks: the whole model), torch fused against compact and master, captured.
export PYTHONPATH=$PWD:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
timeout -k 5 150 python3 tools/gpu_probes/adamw_probe.py > $OUT/adamw.txt 2>&1
timeout -k 5 100 python3 tools/gpu_probes/adamw_probe.py --layers 8 >> $OUT/adamw.txt 2>&1
