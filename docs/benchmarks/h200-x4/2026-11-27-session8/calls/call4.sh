#!/usr/bin/env bash
# Device call 4 (4 GPUs, the session's last ~5 minutes): resharding pp=2 -> pp=4 and pp=2 x dp=2 sharded -> pp=4
# (cut by call 3's time limit), and beside it on GPU 0 (correctness only, no timing) the two GPU kernel tests
# rewritten for pl_flat.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/machine.txt 2>&1
sumup() { cp /tmp/$1/summary.txt $OUT/tests-$1.txt 2>/dev/null; cp /tmp/$1/w/runs/failures.txt $OUT/tests-$1-failures.txt 2>/dev/null; }
( OUT=/tmp/p4 LIMIT=220 TESTS="tests/gpu/test_checkpoint_reshard_gpu.py" \
    bash tools/gpu_checks.sh -v -k "pp2-pp4 or pp2dp2s-pp4" > /dev/null 2>&1; sumup p4 ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=0
  OUT=/tmp/g0 LIMIT=150 TESTS="tests/gpu/test_kernels_elementwise.py" \
    bash tools/gpu_checks.sh -v -k "rounds_grid_beyond_resident or one_pass_in_both" > /dev/null 2>&1; sumup g0 ) &
wait
echo "done at $SECONDS s" >> $OUT/machine.txt
