#!/usr/bin/env bash
# Device call 3 (2 GPUs). Phase 1 side by side: GPU 0 the fused-linear GPU tests (the block's direct torch ops ==
# the per-op path), then the one-GPU eager profiles (mid bf16, launch bf16, mid autocast); GPU 1 the one-GPU
# schedule tests. Phase 2 alone: the eager MLP suite (launch, mid, compute; pp=2 and one GPU).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_linear_gpu.py > $B/tests-g0.txt 2>&1
  echo "tests rc=$? at $SECONDS s" >> $B/tests-g0.txt
  for c in "mid bf16" "launch bf16" "mid autocast"; do set -- $c
    echo "=== $1 $2" >> $B/profile.txt
    PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu_probes timeout -k 5 100 python3 tools/gpu_probes/eager_single_profile.py \
      --config $1 --recipe $2 --top 30 >> $B/profile.txt 2>&1
    echo "profile rc=$? at $SECONDS s" >> $B/profile.txt
  done ) &
sleep 5
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_schedules_gpu.py -k one_gpu > $B/tests-g1.txt 2>&1
  echo "tests rc=$? at $SECONDS s" >> $B/tests-g1.txt ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((560 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager > $B/eager.log 2>&1
echo "eager rc=$? at $SECONDS s" >> $B/eager.log
cp $B/profile.txt $B/tests-g0.txt $B/tests-g1.txt $OUT/ 2>/dev/null
{ for r in eager; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; tail -3 $B/eager.log; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
