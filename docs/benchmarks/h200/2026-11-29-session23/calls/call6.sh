#!/usr/bin/env bash
# Device call 6 (one GPU): MasterAdamW's one-kernel step. Its GPU tests (bit for bit against torch's fused AdamW,
# captured steps, device lr and found_inf, the GPT jobs with --precision master) and compact's (the shared tables);
# the AdamW probe with the chunked torch ops as the same-run anchor; the GPT 8 x 4096 on one GPU with --precision
# master against --precision bf16 (1F1B, graphs).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site:$PWD/tools/gpu_probes PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader; nproc; echo tree $(cat calls/TREE); } > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
OUT=$B/t LIMIT=200 TESTS="tests/gpu/test_master_adamw_gpu.py tests/gpu/test_compact_adamw_gpu.py" \
  bash tools/gpu_checks.sh > /dev/null 2>&1
cp $B/t/summary.txt $OUT/tests-summary.txt
echo "tests done at $SECONDS s" >> $OUT/machine.txt
timeout -k 5 100 python3 tools/gpu_probes/adamw_probe.py 2>&1 | grep -v Warning > $OUT/adamw.txt
echo "probe done at $SECONDS s" >> $OUT/machine.txt
GPT="--model gpt --layers 8 --hidden 4096 --heads 32 --seq 4096 --micro-batch-size 1 -m 8 --dtype bf16 --schedule 1f1b"
for rec in master bf16 master bf16; do
  timeout -k 10 100 python3 launch/pipeline.py $GPT --precision $rec --iters 12 > $B/gpt-$rec.log 2>&1
  python3 - $B/gpt-$rec.log $rec >> $OUT/gpt.txt <<'PY'
import re, statistics, sys
text = open(sys.argv[1]).read()
ms = [float(m) for m in re.findall(r"\| ([0-9.]+) ms/iter", text)]
tail = ms[len(ms) // 2:]
peak = re.findall(r"peak ([0-9.]+) GiB", text)
print(f"--precision {sys.argv[2]}: median of the last {len(tail)} iterations {statistics.median(tail):.2f} ms/iter "
      f"(min {min(tail):.2f}, max {max(tail):.2f}); peak {peak[-1] if peak else '?'} GiB" if tail else
      f"--precision {sys.argv[2]}: no timings: {text[-600:]}")
PY
done
echo "done at $SECONDS s" >> $OUT/machine.txt
cat $OUT/machine.txt $OUT/adamw.txt $OUT/gpt.txt; tail -n 25 $OUT/tests-summary.txt
