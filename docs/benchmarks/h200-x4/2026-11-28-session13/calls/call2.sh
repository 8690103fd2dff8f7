#!/usr/bin/env bash
# Device call 2 (4 GPUs). Phase 1 side by side: GPUs 0,1 the GPU tests of zb-interleaved at pp=2 (MLP: 4 stages per
# rank over the copy engine with graphs and NCCL eager, --zb-memory 1f1b; GPT: 3 stages per rank, fp32 and pure bf16)
# and of zbv's re-planned fast order (MLP placed pp=2, GPT zbv); GPUs 2,3 the MLP pipeline at pp=2, M=8 (peerline
# ZB-H1 / ZBV / zb-interleaved graphs against torch's 1F1B and ZBV, bf16 parameters), then the GPT at 8 x 4096 /
# seq 4096 at pp=2 (ZBV, zb-interleaved against the plain torch GPT's compiled 1F1B, both recipes).
# Phase 2, 4 GPUs: the MLP pipeline at pp=4, M=8 (ZBV, zb-interleaved), then the pp=4 GPU tests of zb-interleaved.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv,noheader; nproc; echo tree 582e84c; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
MLP="--pipeline-configs compute --variants torch,graph --pipeline-anchor-schedules 1f1b,zbv
  --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1"
( export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/t2 LIMIT=240 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v \
    -k "zb_interleaved or zb-interleaved or (zb_memory and not zb-h1) or (placed_pp2 and zbv-copy-engine---graph) or (placed_pp2 and zbv-nccl---no-graph) or zbv-copy-engine-graph" > /dev/null 2>&1
  echo "tests-pp2 done at $SECONDS s" >> $OUT/machine.txt ) &
P1=$!
sleep 5
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 120 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py pipeline $MLP \
    --schedules zb-h1,zbv,zb-interleaved --out $B/mlp-pp2 > $B/mlp-pp2.log 2>&1
  echo "mlp-pp2 rc=$? at $SECONDS s" >> $B/mlp-pp2.log
  timeout -k 10 $((275 - SECONDS)) torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py gpt \
    --gpt-configs compute --gpt-layers 8 --gpt-hidden 4096 --gpt-heads 32 --gpt-seq 4096 --gpt-variants torch,graph \
    --gpt-schedules zbv,zb-interleaved --gpt-precisions bf16 --gpt-anchor-compile on --gpt-anchor-schedules 1f1b \
    --reps 3 --warmup 1 --out $B/gpt-8x4096-pp2 > $B/gpt-8x4096-pp2.log 2>&1
  echo "gpt-8x4096-pp2 rc=$? at $SECONDS s" >> $B/gpt-8x4096-pp2.log ) &
P2=$!
wait $P1 $P2
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 120 torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline $MLP --schedules zbv,zb-interleaved \
  --out $B/mlp-pp4 > $B/mlp-pp4.log 2>&1
echo "mlp-pp4 rc=$? at $SECONDS s" >> $B/mlp-pp4.log
left=$((545 - SECONDS))
if [ $left -gt 50 ]; then
  OUT=/tmp/t4 LIMIT=$left TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v \
    -k "zb_interleaved_pp4 or (zero_bubble_pp4 and zb-interleaved)" > /dev/null 2>&1
fi
echo "collect at $SECONDS s" >> $OUT/machine.txt
for t in t2 t4; do
  cp /tmp/$t/summary.txt $OUT/tests-$t.txt 2>/dev/null
  tar -xzf /tmp/$t/logs.tgz -C /tmp/$t w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR" /tmp/$t/w/pytest.log > $OUT/tests-$t-lines.txt
done
{ for r in mlp-pp2 gpt-8x4096-pp2 mlp-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "Error|error:|rc=" $B/$r.log | tail -n 5; done; } > $OUT/results.md
for r in mlp-pp2 gpt-8x4096-pp2 mlp-pp4; do tail -n 40 $B/$r.log > $OUT/$r-log-tail.txt 2>/dev/null; done
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
