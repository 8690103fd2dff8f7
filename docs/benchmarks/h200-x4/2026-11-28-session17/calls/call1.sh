#!/usr/bin/env bash
# Device call 1: the LayerNorm's residual backward (pl_ln_backward_res[_sum]) under the residual-MLP and GPT blocks.
# GPUs 0,1: GPU tests (layer norm kernels incl. the residual ones and both blocks in bf16 against torch's ops; the
# MLP pipeline's one-GPU checks, pp=2 against one GPU, the README default), then layer_norm_probe.py --residual and
# the plain probe. GPUs 2,3 at the same time: the MLP pipeline pp=2, M=8 and M=16, ZB-H1 / ZBV graphs, --precision
# bf16, against torch's 1F1B with bf16 parameters (this tree), then the base tree's ZB-H1 / ZBV graphs (calls/base,
# the session's start) in the same configurations. Then pp=4 M=8 on all four GPUs (this tree).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE) base $(cat calls/BASE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
ROOT=$PWD
collect() {
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 30 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$1.jsonl
}
bench_pp2() {  # GPUS PORT NAME DIR VARIANTS EXTRA...
  local gpus=$1 port=$2 name=$3 dir=$4 variants=$5; shift 5
  (cd $dir && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=$dir:/tmp/site timeout -k 10 200 torchrun --standalone --master-port=$port \
    --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute,compute16 --variants $variants \
    --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --schedules zb-h1,zbv \
    --pipeline-precisions bf16 --out $B/$name "$@" > $B/$name.log 2>&1)
  echo "$name rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect $name
}
tests() {
  CUDA_VISIBLE_DEVICES=0,1 OUT=$B/tests LIMIT=300 TESTS="tests/gpu/test_layer_norm_gpu.py tests/gpu/test_pipeline_gpu.py" \
    bash tools/gpu_checks.sh -k "layer_norm or residual or test_one_gpu or readme_default or pp2_matches_one_gpu" > /dev/null 2>&1
  cp $B/tests/summary.txt $OUT/tests-summary.txt
  echo "tests done at $SECONDS s" >> $OUT/machine.txt
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python3 tools/gpu_probes/layer_norm_probe.py --residual > $OUT/ln-probe-residual.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python3 tools/gpu_probes/layer_norm_probe.py --shapes 4096x2048,2048x3072 > $OUT/ln-probe.txt 2>&1
  echo "probes rc=$? at $SECONDS s" >> $OUT/machine.txt
}
benches() {
  bench_pp2 $1 29611 mlp-pp2 $ROOT torch,graph
  bench_pp2 $1 29612 mlp-pp2-base $ROOT/calls/base graph --no-pipeline-bubble-free
}
if [ "$NGPU" -ge 4 ]; then
  tests & benches 2,3; wait
  timeout -k 10 150 torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
    --variants torch,graph --pipeline-anchor-schedules 1f1b --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
    --schedules zbv --pipeline-precisions bf16 --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
  echo "mlp-pp4 rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect mlp-pp4
else
  tests; benches 0,1
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
