#!/usr/bin/env bash
# Device call 1 (one GPU): the one-GPU GPU tests of the schedules, the MLP pipeline and the GPT at this tree (zbv's
# default order is now paper: the one-GPU --stages cases run it); then the GPT 8 x 4096 / seq 4096 split into the four
# stages ZBV uses at pp=2, on one GPU under zb-h1 --stages 4, eager with a timeline: each stage's own F, B and W, and
# the optimizer (how much more rank 0's stages 0 and 3 hold than rank 1's 1 and 2).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B $OUT/tl
OUT=$B/tests LIMIT=330 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_gpt_gpu.py" \
  bash tools/gpu_checks.sh > /dev/null 2>&1
cp $B/tests/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
GPT="--model gpt --layers 8 --hidden 4096 --heads 32 --seq 4096 --micro-batch-size 1 -m 8 --dtype bf16 --precision bf16"
timeout -k 10 150 python3 launch/pipeline.py $GPT --schedule zb-h1 --stages 4 --iters 3 --no-graph \
  --timeline $OUT/tl/gpt-zbh1-stages4 > $B/tl-gpt.log 2>&1; echo "tl-gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
rm -f $OUT/tl/*.png; tar czf $OUT/tl.tgz -C $OUT tl && rm -rf $OUT/tl
tail -n 5 $B/tl-gpt.log > $OUT/log-tails.txt 2>&1
cat $OUT/machine.txt; tail -n 30 $OUT/tests-summary.txt
