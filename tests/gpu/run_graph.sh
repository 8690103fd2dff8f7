#!/usr/bin/env bash
# One GPU (issue 6 benchmark, issue 8 tools): GPU checks of the timing pieces (CUDA-event timelines, block timer,
# stage times), then the graph suite: the launch-bound step whole-graphed by peerline vs peerline eager, torch
# eager and the same step captured by hand with torch.cuda.graph. Logs to $OUT/graph.log; results under
# $OUT/bench_graph/. Prints one PASS/FAIL/SKIP line per check; exits 0. About 2 minutes.
set -u
OUT="${1:-${OUT:-/tmp/peerline-gpu}}"
mkdir -p "$OUT"
LOG="$OUT/graph.log"
cd "$(dirname "$0")/../.." || exit 0
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
: > "$LOG"

# peerline must be importable: use the installed package (or run.sh's shim), else a temporary shim of symlinks.
if ! "$PY" -c "import peerline.launch.benchkit" >/dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/peerline"
  ln -s "$ROOT/peerline/__init__.py" "$SHIM/peerline/__init__.py"
  for d in distributed kernels launch; do ln -s "$ROOT/$d" "$SHIM/peerline/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "run_graph: using import shim $SHIM" >> "$LOG"
fi

report() {  # report NAME RC
  if [ "$2" -eq 0 ]; then echo "PASS bench.$1"; else echo "FAIL bench.$1 (rc $2, see $LOG)"; fi
}

NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
if [ "${NGPU:-0}" -lt 1 ]; then
  echo "SKIP bench (no CUDA device)"
  exit 0
fi

echo "== GPU checks of timelines, block timer, stage times (pytest)" >> "$LOG"
timeout -k 5 45 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_bench_gpu.py \
  > "$OUT/bench_tests.out" 2>&1
rc=$?
cat "$OUT/bench_tests.out" >> "$LOG"
tail -n 1 "$OUT/bench_tests.out" | sed 's/^/  /'
report timing_tests "$rc"

echo "== graph suite: one GPU, launch-bound step, peerline eager/graph vs torch eager / hand-captured graph" >> "$LOG"
timeout -k 5 75 "$PY" launch/bench.py graph --out "$OUT/bench_graph" \
  > "$OUT/bench_graph.out" 2>&1
rc=$?
cat "$OUT/bench_graph.out" >> "$LOG"
[ -f "$OUT/bench_graph/results.md" ] && cat "$OUT/bench_graph/results.md"
report graph_suite "$rc"

exit 0
