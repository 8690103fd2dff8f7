#!/usr/bin/env bash
# Device call 1 (2 GPUs). The MLP pipeline at pp=2, M=8 and M=16 (ZB-H1 / ZBV graphs, --precision bf16) against
# torch's 1F1B and ZBV with bf16 parameters, with the bubble-free record and the stage-alone ideal on a GPU for the
# first time; pipeline_profile at pp=2 ZBV with the ranks on GPUs 0,1 and then 1,0 (does rank 0's slower GEMM follow
# the GPU or the role?); the one-GPU eager profile at the launch shape, bf16 (both sides timed before profiling);
# the GPT at 16 x 3072 with --gpt-zb-memory fast,1f1b against the compiled plain torch GPT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # $1 finished so far into $OUT (the call may be cut); its JSON lines appended to $OUT/$2.jsonl
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 30 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
timeout -k 10 260 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute,compute16 \
  --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
  --schedules zb-h1,zbv --pipeline-precisions bf16 --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
collect mlp-pp2 mlp-pp2
echo "mlp done at $SECONDS s" >> $OUT/machine.txt
for order in 0,1 1,0; do
  CUDA_VISIBLE_DEVICES=$order timeout -k 10 80 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py \
    --config compute --schedule zbv --precision bf16 --top 8 > $B/probe-$order.txt 2>&1
  echo "probe $order rc=$? at $SECONDS s" >> $OUT/machine.txt
  { echo "##### GPUs $order"; grep -v "^\[rank" $B/probe-$order.txt; } >> $OUT/probes.txt
done
CUDA_VISIBLE_DEVICES=1 timeout -k 10 150 python3 tools/gpu_probes/eager_single_profile.py --config launch --recipe bf16 \
  --top 25 > $OUT/profile-launch-bf16.txt 2>&1
echo "eager profile rc=$? at $SECONDS s" >> $OUT/machine.txt
left=$((555 - SECONDS))
if [ $left -gt 130 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-layers 16 --gpt-hidden 3072 --gpt-heads 24 --gpt-seq 1024 --gpt-mbs 2 --gpt-variants torch,graph \
    --gpt-schedules zbv --gpt-zb-memory fast,1f1b --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt-16x3072 > $B/gpt-16x3072.log 2>&1
  echo "gpt-16x3072 rc=$? at $SECONDS s" >> $B/gpt-16x3072.log
  collect gpt-16x3072 gpt-16x3072
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
