#!/usr/bin/env bash
# Warp-specialized elementwise kernels (issue 3) on the GPU machine: correctness tests against float64, the SASS
# report (LDGSTS, registers, shared memory), the kernels benchmark and the multi-stream batch driver.
# Usage: bash tests/gpu/run_kernels.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/kernels.log; SASS report under $OUT/kernels_sass/, bench results under $OUT/bench_kernels/.
# Prints one PASS/FAIL/SKIP line per check and the bench's GOAL lines (tables: $OUT/bench_kernels/*.md and the
# log); exits 0. Bounded to 3 minutes in all (each step under `timeout`; the kernels bench writes its table after
# each size, so a cut run keeps what it finished). First H200 run: pytest 29 s.
. "$(dirname "$0")/common.sh" kernels "${1:-}"

NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "SKIP kernels (no CUDA device)"
  exit 0
fi

echo "== correctness (pytest, float64 references)" >> "$LOG"
timeout -k 5 45 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_kernels_elementwise.py \
  > "$OUT/kernels_tests.out" 2>&1
rc=$?
cat "$OUT/kernels_tests.out" >> "$LOG"
report tests "$rc" "$(tail -n 1 "$OUT/kernels_tests.out" | tr -d '=' | sed 's/^ *//; s/ *$//')"

echo "== SASS report (nvcc -cubin + cuobjdump)" >> "$LOG"
ARCH="$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'sm_{a}{b}')" 2>>"$LOG")"
timeout -k 5 25 "$PY" -m peerline.kernels.inspect_sass --arch "${ARCH:-sm_90}" --out "$OUT/kernels_sass" \
  > "$OUT/kernels_sass.out" 2>&1
rc=$?
cat "$OUT/kernels_sass.out" >> "$LOG"
sed 's/^/  /' "$OUT/kernels_sass.out" | grep -E "PASS|FAIL|error" || true
report sass_ldgsts "$rc"

echo "== bench: kernels (peerline vs torch eager vs d2d copy)" >> "$LOG"
# 1024 MiB left out here (the goals start at 256 MiB; the suite's default sizes still include it).
timeout -k 5 55 "$PY" -m peerline.launch.suites.kernels --out "$OUT/bench_kernels" --sizes-mib 1,16,256 \
  > "$OUT/bench_kernels.out" 2>&1
rc=$?
cat "$OUT/bench_kernels.out" >> "$LOG"
grep -E "^GOAL " "$OUT/bench_kernels.out" || echo "  (no GOAL lines: see $LOG)"
report bench_kernels "$rc"

echo "== bench: batch_streams (multi-stream batch driver)" >> "$LOG"
timeout -k 5 15 "$PY" -m peerline.launch.suites.batch_streams --out "$OUT/bench_kernels" \
  > "$OUT/bench_batch_streams.out" 2>&1
rc=$?
cat "$OUT/bench_batch_streams.out" >> "$LOG"
report bench_batch_streams "$rc"

# compute-sanitizer over small launches of every path (last: the first thing to drop if time runs short).
# racecheck may not model mbarrier/cp.async ordering on every version: read a racecheck FAIL in the log first.
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
if [ -z "$SAN" ]; then
  echo "SKIP kernels.sanitize (compute-sanitizer not found)"
else
  # -lineinfo builds: hazards are reported with lines of the pasted source, written next to the log
  "$PY" -c "from peerline.kernels import compile as kc; print(kc.source_text(), end='')" \
    > "$OUT/kernels_source_for_lineinfo.cu" 2>>"$LOG"
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool" >> "$LOG"
    limit=15; [ "$tool" = racecheck ] && limit=25
    PEERLINE_KERNEL_LINEINFO=1 timeout -k 5 "$limit" "$SAN" --tool "$tool" --error-exitcode 3 "$PY" tests/gpu/kernels_sanitize.py >> "$LOG" 2>&1
    report "sanitize_$tool" $?
  done
fi
exit 0
