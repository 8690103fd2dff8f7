#!/usr/bin/env bash
# Device call 2 (2 GPUs). Phase 1, both GPUs alone: the eager suite at pp=2 (the recipe-matched pairs
# interleaved). Phase 2, GPU 0 alone: the eager suite's one-GPU part, then the one-GPU eager profile at the launch
# shape (bf16). Phase 3, both GPUs: the gpt suite at pp=2 at 8 x 4096 / seq 4096 (ZB-H1 and ZBV x --zb-memory
# fast,1f1b against the plain torch GPT's 1F1B, eager and compiled blocks), GPU clocks and power sampled.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree f881ec8; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
timeout -k 10 170 torchrun --standalone --nproc_per_node=2 launch/bench.py eager --no-eager-single \
  --eager-variants torch,torch-bf16,peerline-autocast,peerline-bf16 --reps 3 --warmup 1 --out $B/eager-pp2 > $B/eager-pp2.log 2>&1
echo "eager-pp2 rc=$? at $SECONDS s" >> $B/eager-pp2.log
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 torchrun --standalone --nproc_per_node=1 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager-one > $B/eager-one.log 2>&1
echo "eager-one rc=$? at $SECONDS s" >> $B/eager-one.log
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PYTHONPATH:$PWD/tools/gpu_probes timeout -k 5 80 python3 \
  tools/gpu_probes/eager_single_profile.py --config launch --recipe bf16 --top 30 > $B/profile-launch-bf16.txt 2>&1
echo "profile rc=$? at $SECONDS s" >> $B/profile-launch-bf16.txt
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 250 > $B/clocks.csv 2>&1 &
SMI=$!
timeout -k 10 $((565 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
  --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 \
  --gpt-variants torch,graph --gpt-schedules zb-h1,zbv --gpt-precisions bf16 --gpt-zb-memory fast,1f1b \
  --gpt-anchor-compile both --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out $B/gpt-pp2 > $B/gpt-pp2.log 2>&1
echo "gpt-pp2 rc=$? at $SECONDS s" >> $B/gpt-pp2.log
kill $SMI 2>/dev/null
{ for r in eager-pp2 eager-one gpt-pp2; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; done; } > $OUT/results.md
cp $B/profile-launch-bf16.txt $OUT/ 2>/dev/null
tail -n 40 $B/gpt-pp2.log > $OUT/gpt-pp2-log-tail.txt
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
