#!/usr/bin/env bash
# Device call 5 (2 GPUs, side by side): host time per call of one GPT block (gpt_block_host_probe, the launch-bound
# GPT's block), tree efc09b2 (the tenth session's, whose eager GPT ran 1.22x / 1.12x torch's eager) on GPU 0 and
# this tree on GPU 1: where the eager GPT's host time went since.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
OLD=/tmp/old; mkdir -p $OLD && tar -xzf calls/old-efc09b2.tgz -C $OLD
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE), old efc09b2; } > $OUT/machine.txt 2>&1
(cd $OLD && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$OLD:/tmp/site:$OLD/tools/gpu_probes timeout -k 5 110 python3 tools/gpu_probes/gpt_block_host_probe.py > $OUT/probe-old.txt 2>&1) &
a=$!
CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes timeout -k 5 110 python3 tools/gpu_probes/gpt_block_host_probe.py > $OUT/probe-new.txt 2>&1 &
b=$!
wait $a; echo "old rc=$? at $SECONDS s" >> $OUT/machine.txt
wait $b; echo "new rc=$? at $SECONDS s" >> $OUT/machine.txt
