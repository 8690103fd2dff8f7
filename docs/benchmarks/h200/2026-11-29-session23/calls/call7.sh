#!/usr/bin/env bash
# Device call 7 (one GPU): MasterAdamW's kernel in torch's current fp32 arithmetic: its GPU tests (bit for bit against
# torch's fused AdamW, captured steps, device lr and found_inf, the GPT jobs) and the AdamW probe.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/t LIMIT=150 TESTS="tests/gpu/test_master_adamw_gpu.py" bash tools/gpu_checks.sh > /dev/null 2>&1
cp $B/t/summary.txt $OUT/tests-summary.txt
timeout -k 5 60 python3 tools/gpu_probes/adamw_probe.py --reps 5 2>&1 | grep -v Warning > $OUT/adamw.txt
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt $OUT/adamw.txt; head -n 40 $OUT/tests-summary.txt
