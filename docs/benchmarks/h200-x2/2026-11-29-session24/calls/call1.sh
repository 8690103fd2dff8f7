#!/usr/bin/env bash
# Device call 1 (2 GPUs): the GPT 8 x 4096 pp=2 ZBV profile (each rank's idle intervals), then the owed GPU tests:
# list orders, the user model's pp=2 cases, the optimizer kernels after the launch/table refactors.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
mkdir -p /tmp/tr
timeout -k 5 170 torchrun --standalone --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py --gpt 8x4096 --heads 32 \
  --seq 4096 --micro-batch-size 1 --microbatches 8 --schedule zbv --iters 2 --timed 6 --top 25 --trace-dir /tmp/tr \
  > $OUT/profile.txt 2>&1
echo "profile rc=$? at $SECONDS s" >> $OUT/machine.txt
tar czf $OUT/traces.tgz -C /tmp/tr . 2>/dev/null; [ $(stat -c %s $OUT/traces.tgz) -gt 15000000 ] && rm -f $OUT/traces.tgz
OUT=$OUT/t2 LIMIT=360 TESTS="tests/gpu/test_schedules_gpu.py tests/gpu/test_gpt_gpu.py tests/gpu/test_master_adamw_gpu.py tests/gpu/test_fused_bf16_adamw_gpu.py tests/gpu/test_compact_adamw_gpu.py tests/gpu/test_shard_optimizer_gpu.py" \
  bash tools/gpu_checks.sh -k "zbv_orders_pp2 or zb_memory_1f1b or zb-order-list or zbv-zb-memory or (user_model and pp2) or adamw or (dp2_sharded and master)"
echo "tests rc=$? at $SECONDS s" >> $OUT/machine.txt
rm -f $OUT/t2/logs.tgz.big 2>/dev/null
cat $OUT/machine.txt; grep -E "INFO" $OUT/profile.txt | head -60; cat $OUT/t2/summary.txt | head -40
