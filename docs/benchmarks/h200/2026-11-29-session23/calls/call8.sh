#!/usr/bin/env bash
# Device call 8 (one GPU): --precision bf16 stepping through our kernel (FusedBf16AdamW): its GPU tests (bit for bit
# against torch's fused AdamW: eager, captured, found_inf, load_state_dict; the GPT job graph vs eager), MasterAdamW's
# and compact's after the shared kernel file and tables; the AdamW probe.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/t LIMIT=170 TESTS="tests/gpu/test_fused_bf16_adamw_gpu.py tests/gpu/test_master_adamw_gpu.py tests/gpu/test_compact_adamw_gpu.py" \
  bash tools/gpu_checks.sh -k "not gpt_master_one_gpu" > /dev/null 2>&1
cp $B/t/summary.txt $OUT/tests-summary.txt
timeout -k 5 60 python3 tools/gpu_probes/adamw_probe.py --reps 5 2>&1 | grep -v Warning > $OUT/adamw.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt $OUT/adamw.txt; head -n 40 $OUT/tests-summary.txt
