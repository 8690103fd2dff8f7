#!/usr/bin/env bash
# Device call 4 (4 GPUs). Phase 1 side by side: GPUs 0,1 the GPT tests at pp=2 (every schedule, graphs and eager,
# tied, recompute, bf16) on the changed RoPE path; GPUs 2,3 the GPT bench at pp=2, compute shape, peerline 1F1B,
# ZB-H1 and ZBV graphs (bf16) against the plain torch GPT's eager 1F1B. Phase 2, 4 GPUs: the GPT bench at pp=4, the
# same schedules, the anchor's blocks eager and torch.compile'd, both recipes.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/p01 LIMIT=225 TESTS="tests/gpu/test_gpt_gpu.py" bash tools/gpu_checks.sh -v -k pp2_matches > /dev/null 2>&1
  cp /tmp/p01/summary.txt $B/tests-p01.txt; cp /tmp/p01/w/runs/failures.txt $B/tests-p01-failures.txt 2>/dev/null
  echo "tests p01 done at $SECONDS s" >> $OUT/machine.txt ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 225 torchrun --standalone --master-port 29611 --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
    --gpt-variants torch,graph --gpt-schedules 1f1b,zb-h1,zbv --gpt-precisions bf16 --gpt-anchor-compile off \
    --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out $B/gpt-pp2 > $B/gpt-pp2.log 2>&1
  echo "gpt-pp2 rc=$? at $SECONDS s" >> $B/gpt-pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
timeout -k 10 $((545 - SECONDS)) torchrun --standalone --nproc_per_node=4 launch/bench.py gpt --gpt-configs compute \
  --gpt-variants torch,graph --gpt-schedules 1f1b,zb-h1,zbv --gpt-precisions bf16 --gpt-anchor-compile both \
  --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 --out $B/gpt-pp4 > $B/gpt-pp4.log 2>&1
echo "gpt-pp4 rc=$? at $SECONDS s" >> $B/gpt-pp4.log
cp $B/tests-p01.txt $OUT/ 2>/dev/null
{ for r in gpt-pp2 gpt-pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; grep -E "error|Error|GOAL" $B/$r.log | tail -n 20; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
