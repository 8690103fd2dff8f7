#!/usr/bin/env bash
# Device call 2 (4 GPUs). GPU 0: layer_norm_probe.py over the LayerNorm launch variants (rows per block pass x
# backward blocks per multiprocessor; the tree's is R = 4 / V with two blocks). GPU 1: the eager suite's one-GPU
# part at the launch and mid shapes. GPUs 2,3: the GPT at 16 x 3072 / seq 1024, pp=2, ZBV fast and --zb-memory 1f1b
# against the compiled plain torch GPT (the fused LayerNorm's new launch in the GPT).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
sweep() {
  extras=""; for d in calls/ln_*; do extras="$extras --extra ${d#calls/ln_}=$d/layer_norm.py"; done
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 tools/gpu_probes/layer_norm_probe.py $extras --extra old=calls/old_ln/layer_norm.py \
    > $OUT/ln-sweep.txt 2>&1
  echo "sweep rc=$? at $SECONDS s" >> $OUT/machine.txt
}
eager_one() {
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 300 torchrun --standalone --master-port=29622 --nproc_per_node=1 launch/bench.py eager \
    --eager-configs launch,mid --reps 3 --warmup 1 --out $B/eager-one > $B/eager-one.log 2>&1
  echo "eager-one rc=$? at $SECONDS s" >> $OUT/machine.txt
  { cat $B/eager-one/results.md; tail -n 20 $B/eager-one.log; } > $OUT/eager-one.md 2>&1
  cp $B/eager-one/results.jsonl $OUT/eager-one.jsonl 2>/dev/null
}
gpt() {
  CUDA_VISIBLE_DEVICES=2,3 timeout -k 10 300 torchrun --standalone --master-port=29633 --nproc_per_node=2 launch/bench.py gpt \
    --gpt-configs compute --gpt-layers 16 --gpt-hidden 3072 --gpt-heads 24 --gpt-seq 1024 --gpt-mbs 2 --gpt-variants torch,graph \
    --gpt-schedules zbv --gpt-zb-memory fast,1f1b --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt > $B/gpt.log 2>&1
  echo "gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
  { cat $B/gpt/results.md; tail -n 20 $B/gpt.log; } > $OUT/gpt-16x3072.md 2>&1
  cp $B/gpt/results.jsonl $OUT/gpt-16x3072.jsonl 2>/dev/null
}
sweep & eager_one & gpt & wait
echo "done at $SECONDS s" >> $OUT/machine.txt
