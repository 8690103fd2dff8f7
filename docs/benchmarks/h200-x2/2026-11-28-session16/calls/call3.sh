#!/usr/bin/env bash
# Device call 3 (2 GPUs; no 4-GPU kind was lent), the tree with the captured LayerNorm threshold: GPU tests (layer
# norm kernels, the MLP's one-GPU checks, pp=2 against one GPU, the README default on two GPUs, the GPT on one GPU,
# the --zb-memory 1f1b orders), layer_norm_probe.py, the MLP pipeline pp=2, M=8 and M=16, ZB-H1 / ZBV with
# --precision bf16 against torch's 1F1B and ZBV with bf16 parameters; on H100s also the eager suite at pp=2.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
tests() {
  CUDA_VISIBLE_DEVICES=0,1 OUT=$B/tests LIMIT=300 TESTS="tests/gpu/test_layer_norm_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py" \
    bash tools/gpu_checks.sh -k "layer_norm or test_one_gpu or readme_default or pp2_matches_one_gpu or gpt_one_gpu or zb_memory_1f1b" > /dev/null 2>&1
  cp $B/tests/summary.txt $OUT/tests-summary.txt
  echo "tests done at $SECONDS s" >> $OUT/machine.txt
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python3 tools/gpu_probes/layer_norm_probe.py > $OUT/ln-probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $OUT/machine.txt
}
mlp_pp2() {
  CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 260 torchrun --standalone --master-port=29611 --nproc_per_node=2 launch/bench.py pipeline \
    --pipeline-configs compute,compute16 --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
    --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --schedules zb-h1,zbv --pipeline-precisions bf16 \
    --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect mlp-pp2 mlp-pp2
}
tests; mlp_pp2
if nvidia-smi -L | grep -q H100; then
  timeout -k 10 200 torchrun --standalone --nproc_per_node=2 launch/bench.py eager --eager-configs launch,mid,compute \
    --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 --no-eager-single --reps 3 --warmup 1 \
    --out $B/eager-pp2 > $B/eager-pp2.log 2>&1
  echo "eager-pp2 rc=$? at $SECONDS s" >> $OUT/machine.txt
  collect eager-pp2 eager-pp2
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
