#!/usr/bin/env bash
# Device call 3 (4 GPUs). Phase 1 side by side: GPUs 0,1 the zero-bubble MLP tests at pp=2 the last call did not
# reach (zb-h1 over NCCL, graph and eager; zbv placed, both transports); GPUs 2,3 the MLP pipeline bench at pp=2 M=8
# (peerline 1F1B / ZB-H1 / ZBV graphs with split_backward's lean form, torch's 1F1B and ZBV with bf16 parameters).
# Phase 2: GPUs 0,1 alone, the eager suite at pp=2 (the recipe-matched pairs interleaved), with fc1_gelu_probe on
# GPU 3 (device-bound, one process). Phase 3, 4 GPUs: the MLP pipeline bench at pp=4 M=8.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/p01 LIMIT=205 TESTS="tests/gpu/test_schedules_gpu.py" bash tools/gpu_checks.sh -v \
    -k "(test_pp2_matches and nccl) or (placed_pp2 and zbv)" > /dev/null 2>&1
  cp /tmp/p01/summary.txt $B/tests-pp2.txt; cp /tmp/p01/w/runs/failures.txt $B/tests-pp2-failures.txt 2>/dev/null
  tar -xzf /tmp/p01/logs.tgz -C /tmp/p01 w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR" /tmp/p01/w/pytest.log > $B/tests-pp2-lines.txt
  echo "tests pp2 done at $SECONDS s" >> $OUT/machine.txt ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 200 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py pipeline \
    --pipeline-configs compute --schedules 1f1b,zb-h1,zbv --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
    --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
( CUDA_VISIBLE_DEVICES=3 timeout -k 5 120 python3 tools/gpu_probes/fc1_gelu_probe.py > $B/fc1-gelu-probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $B/fc1-gelu-probe.txt ) &
CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 230 torchrun --standalone --nproc_per_node=2 launch/bench.py eager --no-eager-single \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 --reps 3 --warmup 1 --out $B/eager > $B/eager.log 2>&1
echo "eager rc=$? at $SECONDS s" >> $B/eager.log
wait
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 $((540 - SECONDS)) torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
  --schedules 1f1b,zb-h1,zbv --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
  --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
cp $B/tests-pp2.txt $B/fc1-gelu-probe.txt $OUT/ 2>/dev/null
{ for r in eager mlp-pp2 mlp-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:" $B/$r.log | tail -n 5; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
