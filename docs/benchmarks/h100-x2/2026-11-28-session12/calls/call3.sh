#!/usr/bin/env bash
# Device call 3 (2 GPUs), GPU clocks and power sampled throughout. Phase 1, both GPUs: the MLP pipeline suite at pp=2,
# compute shape at M=8 and M=16 (peerline 1F1B / ZB-H1 / ZBV graphs against torch's 1F1B and ZBV with bf16
# parameters). Phase 2, GPU 0 alone: the eager suite's one-GPU part at the compute shape. Phase 3, both GPUs: the
# gpt suite's launch-bound shape at pp=2 (graph against the plain torch GPT's fastest).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree f881ec8; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 250 > $B/clocks.csv 2>&1 &
SMI=$!
timeout -k 10 290 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute,compute16 \
  --schedules 1f1b,zb-h1,zbv --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv \
  --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0 timeout -k 10 110 torchrun --standalone --nproc_per_node=1 launch/bench.py eager --eager-configs compute \
  --reps 3 --warmup 1 --out $B/eager-one > $B/eager-one.log 2>&1
echo "eager-one rc=$? at $SECONDS s" >> $B/eager-one.log
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 $((535 - SECONDS)) torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs launch \
  --gpt-variants torch,graph --gpt-anchor-compile off --reps 3 --warmup 1 --out $B/gpt-launch > $B/gpt-launch.log 2>&1
echo "gpt-launch rc=$? at $SECONDS s" >> $B/gpt-launch.log
kill $SMI 2>/dev/null
{ for r in mlp-pp2 eager-one gpt-launch; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' --exclude='*.json' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
