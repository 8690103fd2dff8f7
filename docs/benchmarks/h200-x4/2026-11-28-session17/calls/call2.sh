#!/usr/bin/env bash
# Device call 2 (one GPU: no 2- or 4-GPU kind was lent): GPU tests of the residual LayerNorm backward (layer norm
# kernels and both blocks against torch's ops, the MLP pipeline's one-GPU checks, the GPT on one GPU), then the
# eager suite's one-GPU part (launch, mid, compute; peerline against plain torch, both recipes).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/tests LIMIT=330 TESTS="tests/gpu/test_layer_norm_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh -k "layer_norm or residual or test_one_gpu or gpt_one_gpu" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 200 torchrun --standalone --master-port=29622 --nproc_per_node=1 launch/bench.py eager \
  --eager-configs launch,mid,compute --reps 3 --warmup 1 --out $B/eager-one > $B/eager-one.log 2>&1
echo "eager-one rc=$? at $SECONDS s" >> $OUT/machine.txt
{ cat $B/eager-one/results.md; tail -n 20 $B/eager-one.log; } > $OUT/eager-one.md 2>&1
cp $B/eager-one/results.jsonl $OUT/eager-one.jsonl 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt; tail -n 25 $OUT/tests-summary.txt
