#!/usr/bin/env bash
# Device call 3 (2 GPUs; no 4-GPU kind lent), after the zero-bubble fast orders went back to unit time. The pp=2 GPU
# tests of zb-interleaved's unit-time order (MLP, 4 stages per rank, copy engine + graph; GPT with 3 stages per
# rank, fp32 and pure bf16); the MLP pipeline at pp=2, M=8 (ZB-H1, ZBV, zb-interleaved graphs against torch's 1F1B
# and ZBV, bf16 parameters); the GPT at 8 x 4096 / seq 4096 at pp=2 (ZBV, zb-interleaved against the plain torch
# GPT's compiled 1F1B, both recipes) as time allows.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree 373a680; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
collect() {  # what has finished so far, into $OUT (the call may be cut)
  for r in "$@"; do
    { echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; } >> $OUT/results.md
    { echo "##### $r"; tail -n 30 $B/$r.log 2>/dev/null; } >> $OUT/log-tails.txt
    [ -d $B/$r ] && cp $B/$r/results.jsonl $OUT/$r.jsonl 2>/dev/null
  done
}
OUT=/tmp/t2 LIMIT=170 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v \
  -k "(four_stages_per_rank_pp2 and copy-engine) or zb-interleaved-stages3" > /dev/null 2>&1
{ cat /tmp/t2/summary.txt; echo "##### lines"
  tar -xzf /tmp/t2/logs.tgz -C /tmp/t2 w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR" /tmp/t2/w/pytest.log; } > $OUT/tests.txt 2>&1
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 120 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute \
  --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 \
  --schedules zb-h1,zbv,zb-interleaved --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
collect mlp-pp2
left=$((495 - SECONDS))
if [ $left -gt 110 ]; then
  timeout -k 10 $left torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-variants torch,graph \
    --gpt-schedules zbv,zb-interleaved --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt-8x4096-pp2 > $B/gpt-8x4096-pp2.log 2>&1
  echo "gpt-8x4096-pp2 rc=$? at $SECONDS s" >> $B/gpt-8x4096-pp2.log
  collect gpt-8x4096-pp2
fi
echo "done at $SECONDS s" >> $OUT/machine.txt
