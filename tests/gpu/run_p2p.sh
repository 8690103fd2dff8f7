#!/usr/bin/env bash
# Copy-engine transport (issue 4) on the GPU machine: building blocks on one GPU, the transport on two GPUs under
# torchrun, then the p2p bench. Usage: bash tests/gpu/run_p2p.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/p2p.log, bench results to $OUT/bench_p2p/. Prints one PASS/FAIL/SKIP line per check; exits 0.
# Worst case about 4 minutes (every step bounded by timeout); a healthy run takes well under 2.
. "$(dirname "$0")/common.sh" p2p "${1:-}"

NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "SKIP p2p (no CUDA device)"
  exit 0
fi

echo "== building blocks (1 GPU)" >> "$LOG"
timeout -k 5 40 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_p2p_copy_engine.py \
  -k "not two_gpus" >> "$LOG" 2>&1
report building_blocks $?

if [ "$NGPU" -lt 2 ]; then
  echo "SKIP p2p.transport (needs 2 GPUs, found $NGPU)"
  echo "SKIP p2p.bench (needs 2 GPUs, found $NGPU)"
  exit 0
fi

echo "== transport checks (torchrun, 2 ranks)" >> "$LOG"
P2P_CHECK_TIMEOUT=80 timeout -k 5 90 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  tests/gpu/p2p_check.py > "$OUT/p2p_check.out" 2>&1
rc=$?
cat "$OUT/p2p_check.out" >> "$LOG"
grep -E "^(PASS|FAIL) p2p\." "$OUT/p2p_check.out"
report transport "$rc"

echo "== bench (torchrun, 2 ranks)" >> "$LOG"
timeout -k 5 110 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  launch/suites/p2p.py --out "$OUT/bench_p2p" > "$OUT/bench_p2p.out" 2>&1
rc=$?
cat "$OUT/bench_p2p.out" >> "$LOG"
grep -E "^GOAL" "$OUT/bench_p2p.out"
[ -f "$OUT/bench_p2p/p2p.md" ] && cat "$OUT/bench_p2p/p2p.md"
report bench "$rc"
exit 0
