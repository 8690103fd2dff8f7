#!/usr/bin/env bash
# Device call 2 (2 GPUs). Chrome traces of the captured MLP pipeline at pp=2, M=8, --precision bf16 (ZBV and ZB-H1)
# to find where each rank idles between its kernels; the one-GPU eager profile at the compute shape (torch's kernels
# of the plain MLP beside peerline's, per forward and backward).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
for sch in zbv zb-h1; do
  timeout -k 10 90 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py \
    --config compute --schedule $sch --precision bf16 --top 10 --iters 2 --trace-dir /tmp/tr-$sch > /tmp/probe-$sch.txt 2>&1
  echo "probe $sch rc=$? at $SECONDS s" >> $OUT/machine.txt
  { echo "##### $sch"; grep -v "^\[rank\|^W11\|UserWarn\|_warn_once" /tmp/probe-$sch.txt; } >> $OUT/probes.txt
  for r in 0 1; do cp /tmp/tr-$sch/rank$r.json.gz $OUT/trace-$sch-rank$r.json.gz 2>/dev/null; done
done
ls -la $OUT >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 tools/gpu_probes/eager_single_profile.py --config compute --recipe bf16 \
  --no-with-stack --top 25 > $OUT/profile-compute-bf16.txt 2>&1
echo "eager profile rc=$? at $SECONDS s" >> $OUT/machine.txt
