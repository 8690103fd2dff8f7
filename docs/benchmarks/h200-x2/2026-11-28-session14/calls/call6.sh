#!/usr/bin/env bash
# Device call 6 (2 GPUs, side by side): the one-GPU eager GPT at the compute shape (--gpt-single: peerline
# --stages 1 --no-graph --precision bf16 against the plain torch GPT eager, interleaved), tree efc09b2 on GPU 0 and
# this tree on GPU 1.
set -u
export PYTHONUNBUFFERED=1
OLD=/tmp/old; mkdir -p $OLD && tar -xzf calls/old-efc09b2.tgz -C $OLD
echo tree $(cat calls/TREE), old efc09b2 > $OUT/machine.txt
for t in old new; do
  root=$PWD; gpu=1; [ $t = old ] && { root=$OLD; gpu=0; }
  (cd $root && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$root:/tmp/site timeout -k 5 150 torchrun --standalone --nproc_per_node=1 \
    launch/bench.py gpt --gpt-configs compute --gpt-variants eager --gpt-precisions bf16 --gpt-single --reps 3 --warmup 1 \
    --out /tmp/g-$t > /tmp/g-$t.log 2>&1; echo "$t rc=$? at $SECONDS s" >> $OUT/machine.txt; cp /tmp/g-$t/results.md $OUT/gpt-single-$t.md) &
done
wait
