#!/usr/bin/env bash
# Device call 1 (2 x H200). Phase 1, both GPUs: the gpt suite at pp=2, compute shape, peerline 1F1B / ZB-H1 / ZBV
# graphs (bf16) x --zb-memory fast,1f1b x --kernels auto,torch against the plain torch GPT's 1F1B, eager and
# torch.compile'd blocks, both recipes. Phase 2, GPU 0 alone: fc1_gelu_probe at 2048x2048 and 4096x2048 with
# --graph and with --flush-l2. Phase 3, both GPUs: the --zb-memory 1f1b GPU tests (GPT and MLP, pp=2) and the
# --kernels torch one-GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader; nproc; git log -1 --format=%H 2>/dev/null; } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
timeout -k 10 280 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute \
  --gpt-variants torch,graph --gpt-schedules 1f1b,zb-h1,zbv --gpt-precisions bf16 --gpt-zb-memory fast,1f1b \
  --gpt-kernels auto,torch --gpt-anchor-compile both --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 \
  --out $B/gpt-pp2 > $B/gpt-pp2.log 2>&1
echo "gpt-pp2 rc=$? at $SECONDS s" >> $B/gpt-pp2.log
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
for mode in --graph --flush-l2; do
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 60 python3 tools/gpu_probes/fc1_gelu_probe.py --shapes 2048x2048,4096x2048 $mode \
    >> $B/fc1-gelu-probe.txt 2>&1
  echo "probe $mode rc=$? at $SECONDS s" >> $B/fc1-gelu-probe.txt
done
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
OUT=/tmp/t LIMIT=$((565 - SECONDS)) TESTS="tests/gpu/test_gpt_gpu.py tests/gpu/test_schedules_gpu.py tests/gpu/test_pipeline_gpu.py" \
  bash tools/gpu_checks.sh -v -k "zb_memory or zb-memory or torch_kernels" > /dev/null 2>&1
cp /tmp/t/summary.txt $B/tests.txt; cp /tmp/t/w/runs/failures.txt $B/tests-failures.txt 2>/dev/null
tar -xzf /tmp/t/logs.tgz -C /tmp/t w/pytest.log 2>/dev/null && grep -E "PASSED|FAILED|ERROR" /tmp/t/w/pytest.log > $B/tests-lines.txt
cp $B/tests.txt $B/fc1-gelu-probe.txt $OUT/ 2>/dev/null
{ echo "=== gpt-pp2"; cat $B/gpt-pp2/results.md 2>/dev/null; grep -E "Error|error:|rc=|candidates" $B/gpt-pp2.log | tail -n 8; } > $OUT/results.md
tail -n 60 $B/gpt-pp2.log > $OUT/gpt-pp2-log-tail.txt
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
