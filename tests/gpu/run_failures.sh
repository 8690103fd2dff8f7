#!/usr/bin/env bash
# Failure behaviour on the GPU machine (issue 10): the non-finite guard inside a CUDA graph and a checkpoint of
# CUDA state (1 GPU), then on 2 GPUs a killed rank (NCCL and copy engine), a hung rank whose peer's stream spins
# on a flag, resume == uninterrupted (eager bitwise, graph 1e-6) and --skip-nonfinite. The CPU failure tests too.
# Usage: bash tests/gpu/run_failures.sh [OUT]  (or OUT=...). Logs to $OUT/failures.log; one PASS/FAIL/SKIP line
# per check; always exits 0. Worst case about 6 minutes (every command bounded by timeout).
. "$(dirname "$0")/common.sh" failures "${1:-}"

# pytest -rA prints "PASSED path::test[param]" / "FAILED ..." / "SKIPPED [1] path:line: reason" summary lines.
summarize() {  # summarize LOGFILE
  grep -aE "^(PASSED|FAILED|ERROR) " "$1" | sed -E 's/^PASSED (.*)$/PASS failures.\1/; s/^(FAILED|ERROR) (.*)$/FAIL failures.\2/'
  grep -aE "^SKIPPED " "$1" | sed -E 's/^SKIPPED (\[[0-9]+\] )?/SKIP failures: /'
}

echo "== GPU failure tests (pytest -m gpu tests/gpu/test_failures_gpu.py)" >> "$LOG"
# FAILURES_SELECT (a pytest -k expression) runs a subset when device time is short, e.g. "killed or hung".
timeout -k 10 330 "$PY" -m pytest -q -rA -p no:cacheprovider -m gpu tests/gpu/test_failures_gpu.py \
  ${FAILURES_SELECT:+-k "$FAILURES_SELECT"} \
  > "$OUT/failures_gpu.out" 2>&1
rc=$?
cat "$OUT/failures_gpu.out" >> "$LOG"
summarize "$OUT/failures_gpu.out"
[ $rc -eq 124 ] && echo "FAIL failures.gpu_tests (timed out after 330 s, see $LOG)"

echo "== CPU failure tests (unit + gloo, not slow)" >> "$LOG"
PEERLINE_DEVICE=cpu CUDA_VISIBLE_DEVICES="" timeout -k 10 60 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_checkpoint.py tests/unit/test_watchdog.py tests/unit/test_faults.py > "$OUT/failures_unit.out" 2>&1
rc=$?
cat "$OUT/failures_unit.out" >> "$LOG"
if [ $rc -eq 0 ]; then echo "PASS failures.cpu_unit"; else echo "FAIL failures.cpu_unit (rc $rc, see $LOG)"; fi
exit 0
