#!/usr/bin/env bash
# Device call 3 (2 GPUs). The MLP pipeline at pp=2, M=8, --precision bf16, timed in blocks of 1..20 iterations:
# peerline ZBV and ZB-H1 graphs and torch's 1F1B (bf16 parameters); the fit separates the steady period from what a
# block pays once; the host's time inside each graph launch.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for sch in zbv zb-h1; do
  extra=""; [ $sch = zb-h1 ] && extra="--no-anchor"
  timeout -k 10 150 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/block_length_probe.py \
    --config compute --schedule $sch --precision bf16 $extra > /tmp/blocks-$sch.txt 2>&1
  echo "blocks $sch rc=$? at $SECONDS s" >> $OUT/machine.txt
  { echo "##### $sch"; grep -v "^\[rank\|^W11\|UserWarn\|_warn_once" /tmp/blocks-$sch.txt | tail -n 30; } >> $OUT/blocks.txt
done
