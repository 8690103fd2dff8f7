#!/usr/bin/env bash
# Device call 1 (one GPU): what splitting the backward into B and W costs. The same whole model on one GPU under
# 1F1B (fused backward) and under zb-h1 with one stage (B then W for every microbatch), graphs (the MLP alternated twice):
# the MLP pipeline's compute shape (16 x h2048, micro-batch 8 x 512, M=8, bf16) and the GPT at 8 x 4096 / seq 4096
# (M=8, bf16); then eager timelines of the zb-h1 runs (each F, B and W's own duration).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B $OUT/tl
MLP="--layers 16 --hidden 2048 --micro-batch-size 8 --seq 512 -m 8 --dtype bf16 --precision bf16"
GPT="--model gpt --layers 8 --hidden 4096 --heads 32 --seq 4096 --micro-batch-size 1 -m 8 --dtype bf16 --precision bf16"
one() {  # NAME ITERS ARGS...
  local name=$1 iters=$2; shift 2
  timeout -k 10 120 python3 launch/pipeline.py "$@" --iters $iters > $B/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s" >> $OUT/machine.txt
  python3 - $B/$name.log $name >> $OUT/split.txt <<'PY'
import re, statistics, sys
ms = [float(m) for m in re.findall(r"\| ([0-9.]+) ms/iter", open(sys.argv[1]).read())]
tail = ms[len(ms) // 2:]
print(f"{sys.argv[2]}: median of the last {len(tail)} iterations {statistics.median(tail):.2f} ms/iter "
      f"(min {min(tail):.2f}, max {max(tail):.2f})" if tail else f"{sys.argv[2]}: no timings")
PY
}
for rep in 1 2; do
  one mlp-1f1b-$rep 40 $MLP --schedule 1f1b
  one mlp-zbh1-$rep 40 $MLP --schedule zb-h1
done
one gpt-1f1b-1 14 $GPT --schedule 1f1b
one gpt-zbh1-1 14 $GPT --schedule zb-h1
timeout -k 10 120 python3 launch/pipeline.py $MLP --schedule zb-h1 --iters 4 --no-graph --timeline $OUT/tl/mlp-zbh1 \
  > $B/tl-mlp.log 2>&1; echo "tl-mlp rc=$? at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 150 python3 launch/pipeline.py $GPT --schedule zb-h1 --iters 3 --no-graph --timeline $OUT/tl/gpt-zbh1 \
  > $B/tl-gpt.log 2>&1; echo "tl-gpt rc=$? at $SECONDS s" >> $OUT/machine.txt
rm -f $OUT/tl/*.png; tar czf $OUT/tl.tgz -C $OUT tl && rm -rf $OUT/tl
tail -n 3 $B/mlp-1f1b-1.log $B/gpt-zbh1-1.log $B/tl-gpt.log > $OUT/log-tails.txt 2>&1
cat $OUT/machine.txt $OUT/split.txt
