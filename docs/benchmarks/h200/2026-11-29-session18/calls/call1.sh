#!/usr/bin/env bash
# Device call 1 (one GPU): the GPU tests owed by 723264a (layer norm kernels and blocks, the MLP pipeline's one-GPU
# checks, the GPT on one GPU), then the stage probe at 8 x 4096 / seq 4096 (4 blocks, M=8): peerline's stage against
# the plain torch GPT's, blocks eager and torch.compile'd.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/tests LIMIT=300 TESTS="tests/gpu/test_layer_norm_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh -k "layer_norm or residual or test_one_gpu or gpt_one_gpu" > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
S="--blocks 4 --hidden 4096 --heads 32 --seq 4096 --microbatches 8 --iters 3 --warmup 2 --top 25"
timeout -k 10 150 python3 tools/gpu_probes/stage_kernels_probe.py $S --torch-compile > $OUT/stage-8x4096-compiled.txt 2>&1
echo "probe compiled rc=$? at $SECONDS s" >> $OUT/machine.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt; tail -n 25 $OUT/tests-summary.txt; grep -E "INFO (class|gemm|attention|other|copies|total|torch:|peerline:)" $OUT/stage-8x4096-compiled.txt
