#!/usr/bin/env bash
# Bucketed all-reduce (issue 5) on the GPU machine: the NCCL dp=2 check under torchrun (eager vs per-parameter
# all-reduce and a single-process reference, CUDA-graph capture + replay, timing after replay), the CPU tests of
# the same code (gloo), then the allreduce bench (GradBuckets vs torch DDP, 8 blocks of h=2048).
# Usage: bash tests/gpu/run_buckets.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/buckets.log, bench results to $OUT/bench_allreduce/. Prints one PASS/FAIL/SKIP line per check;
# exits 0. Worst case under 7 minutes (every step bounded by timeout; run.sh gives a section 420 s); a healthy
# run takes about 2.
. "$(dirname "$0")/common.sh" buckets "${1:-}"

# (The CPU checks of the same code run in CI; device time is kept for what needs GPUs.)

NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
if [ "${NGPU:-0}" -lt 2 ]; then
  echo "SKIP buckets.nccl_dp2 (needs 2 GPUs, found ${NGPU:-0})"
  echo "SKIP buckets.bench (needs 2 GPUs, found ${NGPU:-0})"
  exit 0
fi

echo "== NCCL dp=2 checks (torchrun, 2 ranks)" >> "$LOG"
timeout -k 5 140 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  tests/gpu/buckets_gpu_worker.py > "$OUT/buckets_check.out" 2>&1
rc=$?
cat "$OUT/buckets_check.out" >> "$LOG"
grep -E "^(PASS|FAIL) " "$OUT/buckets_check.out" | sed -E 's/^(PASS|FAIL) /\1 buckets.nccl_dp2./'
grep -E "^INFO " "$OUT/buckets_check.out" | sed 's/^/  /'
report nccl_dp2 "$rc"

echo "== bench (torchrun, 2 ranks)" >> "$LOG"
timeout -k 5 160 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  launch/suites/allreduce.py --out "$OUT/bench_allreduce" > "$OUT/bench_allreduce.out" 2>&1
rc=$?
cat "$OUT/bench_allreduce.out" >> "$LOG"
grep -E "^GOAL" "$OUT/bench_allreduce.out"
[ -f "$OUT/bench_allreduce/allreduce.md" ] && cat "$OUT/bench_allreduce/allreduce.md"
report bench "$rc"
exit 0
