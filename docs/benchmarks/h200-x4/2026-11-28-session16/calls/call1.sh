#!/usr/bin/env bash
# Device call 1. The fused LayerNorm with R rows per block pass and the parallel partial reduction, and the MLP block
# on FusedLayerNorm: GPU tests (layer norm kernels, the one-GPU pipeline checks and the README default on two GPUs)
# on GPUs 0,1; layer_norm_probe.py (torch / this tree / the committed kernels); the MLP pipeline pp=2, M=8 and M=16,
# ZB-H1 / ZBV graphs with --precision bf16 against torch's 1F1B and ZBV with bf16 parameters on GPUs 2,3 (after the
# tests where the machine has two GPUs); pp=4 M=8 on four GPUs at the end.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE) old $(cat calls/OLD); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 30 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
mlp_pp2() {
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 260 torchrun --standalone --master-port=$2 --nproc_per_node=2 launch/bench.py pipeline \
    --pipeline-configs compute,compute16 --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
    --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --schedules zb-h1,zbv --pipeline-precisions bf16 \
    --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
  collect mlp-pp2 mlp-pp2
}
tests() {
  CUDA_VISIBLE_DEVICES=0,1 OUT=$B/tests LIMIT=330 TESTS="tests/gpu/test_layer_norm_gpu.py tests/gpu/test_pipeline_gpu.py" \
    bash tools/gpu_checks.sh -k "layer_norm or test_one_gpu or readme_default" > /dev/null 2>&1
  cp $B/tests/summary.txt $OUT/tests-summary.txt
  echo "tests done at $SECONDS s" >> $OUT/machine.txt
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 python3 tools/gpu_probes/layer_norm_probe.py --extra old=calls/old_ln/layer_norm.py \
    > $OUT/ln-probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $OUT/machine.txt
}
if [ "$NGPU" -ge 4 ]; then
  tests & mlp_pp2 2,3 29611; wait
  timeout -k 10 150 torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
    --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
    --schedules zbv,zb-h1 --pipeline-precisions bf16 --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
  echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
  collect mlp-pp4 mlp-pp4
else
  tests; mlp_pp2 0,1 29611
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
