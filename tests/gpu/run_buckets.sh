#!/usr/bin/env bash
# Bucketed all-reduce (issue 5) on the GPU machine, about 80 s healthy, at most ~150 s (every step bounded):
#   1. the NCCL dp=2 check under torchrun (tests/gpu/buckets_gpu_worker.py, what test_buckets_gpu.py runs):
#      bucketed grads vs per-parameter all-reduce (bitwise) and a single-process reference, also on a dp group
#      with NCCL's CTAs capped (buckets.nccl_options), CUDA-graph capture + replay, timing after replay;
#   2. the allreduce bench, bf16 parameters (the DDP anchor's setting): GradBuckets vs torch DDP on 8 blocks of
#      h=2048 at NCCL CTA caps 0 (NCCL's default), 16, 8, 4, DDP at the default and at each cap, and peerline with
#      its all-reduce on a normal-priority stream (priority vs CTA count); then head-to-head rounds (peerline eager
#      and graph vs DDP interleaved, on the anchor model and a launch-heavy one: bench/suites/allreduce_h2h.py).
# Usage: bash tests/gpu/run_buckets.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/buckets.log, bench results to $OUT/bench_allreduce/. Prints one PASS/FAIL/SKIP line per check,
# the bench's GOAL lines (headline cap: the fastest peerline step) and one SWEEP line per cap; exits 0.
. "$(dirname "$0")/common.sh" buckets "${1:-}"

# (The CPU checks of the same code run in CI; device time is kept for what needs GPUs.)

need_gpus 2 buckets.nccl_dp2 buckets.bench

echo "== NCCL dp=2 checks (torchrun, 2 ranks)" >> "$LOG"
t0=$SECONDS
step "$OUT/buckets_check.out" 45 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  tests/gpu/buckets_gpu_worker.py
rc=$?
grep -E "^(PASS|FAIL) " "$OUT/buckets_check.out" | sed -E 's/^(PASS|FAIL) /\1 buckets.nccl_dp2./'
grep -E "^INFO " "$OUT/buckets_check.out" | sed 's/^/  /'
report nccl_dp2 "$rc" "$((SECONDS - t0)) s"

# AR_CTAS (CTA caps swept, 0 = NCCL's default), AR_REPS and AR_EXTRA (more suite flags) shape the bench: e.g.
# AR_CTAS=0,16 AR_REPS=40 AR_EXTRA= for a longer, steadier comparison of two settings against DDP;
# AR_EXTRA="--ar-h2h-only --ar-h2h-rounds 20" for the interleaved step comparison alone.
echo "== bench (torchrun, 2 ranks)" >> "$LOG"
t0=$SECONDS
# shellcheck disable=SC2086 # AR_EXTRA is a list of flags
step "$OUT/bench_allreduce.out" 100 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  bench/suites/allreduce.py --out "$OUT/bench_allreduce" --ar-param-dtype bf16 \
  --ar-nccl-ctas-sweep "${AR_CTAS:-0,16,8,4}" --reps "${AR_REPS:-15}" ${AR_EXTRA---ar-normal-priority}
rc=$?
grep -E "^grad buckets:" "$OUT/bench_allreduce.out" | head -1 | sed 's/^/  /'
grep -E "^(GOAL|SWEEP) " "$OUT/bench_allreduce.out"
[ -f "$OUT/bench_allreduce/allreduce.md" ] && cat "$OUT/bench_allreduce/allreduce.md"
report bench "$rc" "$((SECONDS - t0)) s"

# AR_PROFILE=1: where peerline's eager step spends host time that DDP's does not (a diagnostic, INFO lines only)
if [ "${AR_PROFILE:-0}" = 1 ]; then
  echo "== diagnostic: host profile of the launch-heavy eager step, peerline vs DDP" >> "$LOG"
  step "$OUT/buckets_h2h_profile.out" 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
    tests/gpu/h2h_profile.py
  rc=$?
  grep -E "^INFO " "$OUT/buckets_h2h_profile.out" | sed 's/^/  /'
  report h2h_profile "$rc"
fi
exit 0
