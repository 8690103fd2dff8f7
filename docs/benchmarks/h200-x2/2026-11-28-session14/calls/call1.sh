#!/usr/bin/env bash
# Device call 1 (2 GPUs), tree 1bcb85f+test. GPU tests of the eager auto block (h2048 bf16 now takes the fused
# Linear); the eager suite at the compute shape, bf16 recipe, pp=2 and one GPU, this tree and bbbab2b (before the
# eager Linear rule) in turn; the MLP pipeline at pp=2, M=8, ZB-H1 / ZBV graphs x --precision master,bf16 against
# torch's 1F1B and ZBV with bf16 parameters.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
NEW=$PWD OLD=/tmp/old; mkdir -p $OLD && tar -xzf calls/old-bbbab2b.tgz -C $OLD
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree new 1bcb85f+, old bbbab2b; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # $1 finished so far into $OUT (the call may be cut); its JSON lines appended to $OUT/$2.jsonl
  { echo "=== $1"; cat $B/$1/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$1.log | tail -n 5; } >> $OUT/results.md
  { echo "##### $1"; tail -n 25 $B/$1.log 2>/dev/null; } >> $OUT/log-tails.txt
  [ -f $B/$1/results.jsonl ] && cat $B/$1/results.jsonl >> $OUT/$2.jsonl
}
OUT=/tmp/t1 LIMIT=100 TESTS="tests/gpu/test_fused_linear_gpu.py" bash tools/gpu_checks.sh -v -k "eager_auto" > /dev/null 2>&1
{ cat /tmp/t1/summary.txt; echo "##### lines"
  tar -xzf /tmp/t1/logs.tgz -C /tmp/t1 w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR|SKIPPED" /tmp/t1/w/pytest.log; } > $OUT/tests.txt 2>&1
echo "tests done at $SECONDS s" >> $OUT/machine.txt
for tree in new old; do  # pp=2, the bf16 pair interleaved
  root=$NEW; [ $tree = old ] && root=$OLD
  (cd $root && PYTHONPATH=$root:/tmp/site timeout -k 10 110 torchrun --standalone --nproc_per_node=2 launch/bench.py eager \
    --no-eager-single --eager-configs compute --eager-variants torch-bf16,peerline-bf16 --reps 3 --warmup 1 \
    --out $B/eager-pp2-$tree > $B/eager-pp2-$tree.log 2>&1; echo "eager-pp2-$tree rc=$? at $SECONDS s" >> $B/eager-pp2-$tree.log)
  collect eager-pp2-$tree eager-pp2
done
echo "eager pp2 done at $SECONDS s" >> $OUT/machine.txt
pids=""
for tree in new old; do  # one GPU each, at once: each ratio is within its own process
  root=$NEW; gpu=0; [ $tree = old ] && { root=$OLD; gpu=1; }
  (cd $root && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$root:/tmp/site timeout -k 10 130 torchrun --standalone --nproc_per_node=1 \
    launch/bench.py eager --eager-configs compute --reps 3 --warmup 1 \
    --out $B/eager-one-$tree > $B/eager-one-$tree.log 2>&1; echo "eager-one-$tree rc=$? at $SECONDS s" >> $B/eager-one-$tree.log) &
  pids="$pids $!"
done
wait $pids
collect eager-one-new eager-one; collect eager-one-old eager-one
echo "eager one done at $SECONDS s" >> $OUT/machine.txt
left=$((560 - SECONDS))
if [ $left -gt 90 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute \
    --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
    --schedules zb-h1,zbv --pipeline-precisions master,bf16 --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
  collect mlp-pp2 mlp-pp2
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
