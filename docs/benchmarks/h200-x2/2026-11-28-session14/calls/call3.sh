#!/usr/bin/env bash
# Device call 3 (2 GPUs). Where the host copies or waits between the MLP pipeline's replays (pipeline_profile with
# Python stacks: pp=2 ZBV bf16, then the whole model on GPU 0 beside the one-GPU eager profile at the launch shape,
# bf16, on GPU 1); the GPT's eager rows at pp=2 and on one GPU (compute and launch shapes) after the eager Linear
# rule; the GPT at 16 x 3072 / 24 heads / seq 1024 / micro-batch 2 at pp=2 (ZBV, ZB-H1 graphs, bf16, against the
# plain torch GPT's 1F1B, compiled blocks, bf16 parameters).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # $1 finished so far into $OUT (the call may be cut); its JSON lines appended to $OUT/$2.jsonl
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 25 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
timeout -k 10 100 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py --config compute \
  --schedule zbv --precision bf16 > $B/probe-pp2.txt 2>&1
echo "probe pp2 rc=$? at $SECONDS s" >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0 timeout -k 10 100 python3 tools/gpu_probes/pipeline_profile.py --config compute \
  --schedule 1f1b --precision bf16 > $B/probe-pp1.txt 2>&1 &
p1=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 150 python3 tools/gpu_probes/eager_single_profile.py --config launch --recipe bf16 \
  --top 30 > $B/profile-launch-bf16.txt 2>&1 &
p2=$!
wait $p1; echo "probe pp1 rc=$? at $SECONDS s" >> $OUT/machine.txt
wait $p2; echo "eager profile rc=$? at $SECONDS s" >> $OUT/machine.txt
for f in probe-pp2 probe-pp1; do echo "##### $f"; grep -v "^\[rank" $B/$f.txt; done > $OUT/probes.txt
cp $B/profile-launch-bf16.txt $OUT/
timeout -k 10 220 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --gpt-single \
  --reps 3 --warmup 1 --out $B/gpt-eager > $B/gpt-eager.log 2>&1
echo "gpt-eager rc=$? at $SECONDS s" >> $B/gpt-eager.log
collect gpt-eager gpt-eager
left=$((565 - SECONDS))
if [ $left -gt 100 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-layers 16 --gpt-hidden 3072 --gpt-heads 24 --gpt-seq 1024 --gpt-mbs 2 --gpt-variants torch,graph \
    --gpt-schedules zbv,zb-h1 --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt-16x3072 > $B/gpt-16x3072.log 2>&1
  echo "gpt-16x3072 rc=$? at $SECONDS s" >> $B/gpt-16x3072.log
  collect gpt-16x3072 gpt-16x3072
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
