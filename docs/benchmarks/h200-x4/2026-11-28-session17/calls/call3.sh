#!/usr/bin/env bash
# Device call 3 (4 GPUs). GPUs 2,3: the GPT at 16 x 3072 (seq 1024, micro-batch 2) pp=2, ZBV fast and --zb-memory
# 1f1b, against the plain torch GPT with compiled blocks under 1F1B with bf16 parameters; the base tree's ZBV there;
# then the GPT at 8 x 4096 (seq 4096) pp=2, ZBV against the same anchor. GPU 0 at the same time: the eager suite's
# one-GPU part (launch, mid) from this tree, then from the base tree. Then GPUs 0,1: the pp=2 GPU tests (the MLP
# pipeline against one GPU, the GPT at pp=2).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE) base $(cat calls/BASE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
ROOT=$PWD
collect() {
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 30 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/records.jsonl
}
gpt() {  # NAME DIR LIMIT ARGS...
  local name=$1 dir=$2 limit=$3; shift 3
  (cd $dir && CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=$dir:/tmp/site timeout -k 10 $limit torchrun --standalone --master-port=29633 \
    --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute --gpt-precisions bf16 --reps 3 --warmup 1 \
    --out $B/$name "$@" > $B/$name.log 2>&1)
  echo "$name rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect $name
}
G16="--gpt-layers 16 --gpt-hidden 3072 --gpt-heads 24 --gpt-seq 1024 --gpt-mbs 2 --gpt-schedules zbv"
G8="--gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-schedules zbv"
ANCHOR="--gpt-anchor-compile on --gpt-anchor-schedules 1f1b"
benches() {
  gpt gpt-16x3072 $ROOT 190 $G16 --gpt-variants torch,graph --gpt-zb-memory fast,1f1b $ANCHOR
  gpt gpt-16x3072-base $ROOT/calls/base 80 $G16 --gpt-variants graph --gpt-zb-memory fast,1f1b
  gpt gpt-8x4096 $ROOT 170 $G8 --gpt-variants torch,graph $ANCHOR
}
eager() {  # NAME DIR
  (cd $2 && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$2:/tmp/site timeout -k 10 130 torchrun --standalone --master-port=29622 \
    --nproc_per_node=1 launch/bench.py eager --eager-configs launch,mid --reps 3 --warmup 1 --out $B/$1 > $B/$1.log 2>&1)
  echo "$1 rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect $1
}
gpu01() {
  eager eager-one $ROOT; eager eager-one-base $ROOT/calls/base
  CUDA_VISIBLE_DEVICES=0,1 OUT=$B/tests LIMIT=200 TESTS="tests/gpu/test_pipeline_gpu.py tests/gpu/test_gpt_gpu.py" \
    bash tools/gpu_checks.sh -k "pp2_matches_one_gpu or gpt_pp2" > /dev/null 2>&1
  cp $B/tests/summary.txt $OUT/tests-summary.txt
  echo "tests done at $SECONDS s" >> $OUT/machine.txt
}
gpu01 & benches; wait
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt; tail -n 12 $OUT/tests-summary.txt; grep -hE "^\| (gpt|eager) " $OUT/results.md | cut -c1-230
