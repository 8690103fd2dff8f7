#!/usr/bin/env bash
# Single-GPU mode (issue 7) on the GPU machine: the pinned staging feed and the allocator settings.
# Usage: bash tests/gpu/run_single.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/single.log; bench results under $OUT/bench_single/ (results in single.md / single.jsonl).
# Prints one PASS/FAIL/SKIP line per check and exits 0. Each step is under `timeout`; in all under 3 minutes
# (tests about 1, bench about 1.5 on an H100).
set -u
OUT="${1:-${OUT:-/tmp/peerline-gpu}}"
mkdir -p "$OUT"
LOG="$OUT/single.log"
cd "$(dirname "$0")/../.." || exit 0
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
: > "$LOG"

# peerline must be importable: the installed package, else a temporary shim of symlinks (no pip needed).
if ! "$PY" -c "import peerline.distributed.staging" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/peerline"
  ln -s "$ROOT/peerline/__init__.py" "$SHIM/peerline/__init__.py"
  for d in distributed kernels launch; do ln -s "$ROOT/$d" "$SHIM/peerline/$d"; done
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  echo "run_single: using import shim $SHIM" >> "$LOG"
fi

report() {  # report NAME RC
  if [ "$2" -eq 0 ]; then echo "PASS single.$1"; else echo "FAIL single.$1 (rc $2, see $LOG)"; fi
}

NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "SKIP single (no CUDA device)"
  exit 0
fi

echo "== tests: stages 2/4 == 1 stage with the staging feed, stream overlap, async allocator + graph" >> "$LOG"
timeout -k 5 95 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_single_gpu.py \
  > "$OUT/single_tests.out" 2>&1
rc=$?
cat "$OUT/single_tests.out" >> "$LOG"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/single_tests.out" | tail -n 12 | sed 's/^/  /'
report tests "$rc"

echo "== bench: overlap vs serial vs bound; caching vs async allocator" >> "$LOG"
timeout -k 5 80 "$PY" -m peerline.launch.suites.single --out "$OUT/bench_single" \
  > "$OUT/bench_single.out" 2>&1
rc=$?
cat "$OUT/bench_single.out" >> "$LOG"
[ -f "$OUT/bench_single/single.md" ] && cat "$OUT/bench_single/single.md"
report bench "$rc"
if [ -f "$OUT/bench_single/single.jsonl" ]; then
  "$PY" - "$OUT/bench_single/single.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    x = r.get("extra", {})
    if r["case"].startswith("overlap vs bound"):
        ok = x.get("fraction_of_bound", 0) >= 0.85
        print(f"{'PASS' if ok else 'FAIL'} single.goal_bound: {100 * x.get('fraction_of_bound', 0):.1f}% of the bound (goal 85%)")
    if r["case"].startswith("overlap vs serial"):
        ok = x.get("vs_serial", 0) >= 2.0
        print(f"{'PASS' if ok else 'FAIL'} single.goal_serial: {x.get('vs_serial', 0):.2f}x the serial version (goal 2x)")
PYEOF
fi
exit 0
