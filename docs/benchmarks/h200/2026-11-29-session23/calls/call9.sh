#!/usr/bin/env bash
# Device call 9 (one GPU, call 8's machine still warm): the captured-step test of FusedBf16AdamW as fixed (its allocation
# count spans our step alone).
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_bf16_adamw_gpu.py -k "captured" 2>&1 | tail -5
