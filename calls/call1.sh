#!/usr/bin/env bash
# Device call 1 (one H100 asked by name). In turn, one GPU: tools/kernels_card.sh (the H100 entry re-tuned with the
# one-pass residual add; the kernel GPU tests, the eager residual-add choice of b94416d and the block's direct path
# among them; hostcost); the one-GPU pipeline tests; the kernels suite 1 MiB - 1 GiB; the eager suite's one-GPU
# part (plain torch and peerline --stages 1 interleaved, both recipes, launch / mid / compute).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; nproc; git log -1 --format=%h 2>/dev/null; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=/tmp/card LIMIT=170 BENCH_LIMIT=60 timeout -k 5 300 bash tools/kernels_card.sh -v > /tmp/card.log 2>&1
echo "kernels_card rc=$? at $SECONDS s" >> $OUT/machine.txt
cp kernels/card_plans.json /tmp/card/card_plans_after.json; cp /tmp/card.log /tmp/card/ 2>/dev/null
tar -czf $OUT/card.tgz -C /tmp/card --exclude=w . 2>/dev/null
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pipeline_gpu.py \
  -m "gpu and not gpu2 and not gpu4" > $B/tests-pipeline.txt 2>&1
echo "tests rc=$? at $SECONDS s" >> $B/tests-pipeline.txt
timeout -k 5 120 python3 -m peerline.bench.suites.kernels --sizes-mib 1,2,4,8,16,64,256,1024 --no-variants \
  --out $B/kernels > $B/kernels.log 2>&1
echo "kernels rc=$? at $SECONDS s" >> $B/kernels.log
timeout -k 10 $((560 - SECONDS)) torchrun --standalone --nproc_per_node=1 launch/bench.py eager --reps 3 --warmup 1 \
  --out $B/eager > $B/eager.log 2>&1
echo "eager rc=$? at $SECONDS s" >> $B/eager.log
cp $B/tests-pipeline.txt $OUT/ 2>/dev/null
{ for r in eager kernels; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; tail -3 $B/eager.log $B/kernels.log; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
