#!/usr/bin/env bash
# Device call 4 (2 GPUs). Phase 1 side by side: GPU 0 the fused-linear GPU tests (the block's direct torch ops ==
# the per-op path) and the one-GPU pipeline tests (graph == eager, --stages 2, kernels torch vs peerline);
# GPU 1 the single-GPU mode tests. Phase 2 alone: the eager MLP suite, launch and mid, the recipe-matched variants.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 130 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_linear_gpu.py \
    tests/gpu/test_pipeline_gpu.py -m "gpu and not gpu2 and not gpu4" > $B/tests-g0.txt 2>&1
  echo "tests rc=$? at $SECONDS s" >> $B/tests-g0.txt ) &
sleep 3
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 125 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_single_gpu.py \
    > $B/tests-g1.txt 2>&1
  echo "tests rc=$? at $SECONDS s" >> $B/tests-g1.txt ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((400 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py eager --eager-configs launch,mid \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 --reps 3 --warmup 1 --out $B/eager > $B/eager.log 2>&1
echo "eager rc=$? at $SECONDS s" >> $B/eager.log
cp $B/tests-g0.txt $B/tests-g1.txt $OUT/ 2>/dev/null
{ for r in eager; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; tail -3 $B/eager.log; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
