#!/usr/bin/env bash
# One GPU (issue 6 benchmark, issue 8 tools): GPU checks of the timing pieces (CUDA-event timelines, block timer,
# stage times), then the graph suite: the launch-bound step whole-graphed by peerline vs peerline eager, torch
# eager and the same step captured by hand with torch.cuda.graph. Logs to $OUT/graph.log; results under
# $OUT/bench_graph/. Prints one PASS/FAIL/SKIP line per check; exits 0. About 3 minutes.
. "$(dirname "$0")/common.sh" graph "${1:-}"

need_gpus 1 graph

echo "== GPU checks of timelines, block timer, stage times (pytest)" >> "$LOG"
step "$OUT/bench_tests.out" 45 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_bench_gpu.py
rc=$?
tail -n 1 "$OUT/bench_tests.out" | sed 's/^/  /'
report timing_tests "$rc"

echo "== graph suite: one GPU, launch-bound (32 and 64 layers) and compute-bound steps, peerline eager/graph vs torch eager / hand-captured graph" >> "$LOG"
# shellcheck disable=SC2086 # GRAPH_ARGS: more suite flags, e.g. --graph-shapes compute
step "$OUT/bench_graph.out" 150 "$PY" launch/bench.py graph --out "$OUT/bench_graph" ${GRAPH_ARGS:-}
rc=$?
[ -f "$OUT/bench_graph/results.md" ] && cat "$OUT/bench_graph/results.md"
report graph_suite "$rc"

# GRAPH_PROBE=1: host cost of cudaGraphLaunch by kernel kind and node count (a diagnostic, INFO lines only)
if [ "${GRAPH_PROBE:-0}" = 1 ]; then
  echo "== diagnostic: graph launch probe" >> "$LOG"
  step "$OUT/graph_launch_probe.out" 40 "$PY" tests/gpu/graph_launch_probe.py
  rc=$?
  grep -E "^INFO " "$OUT/graph_launch_probe.out" | sed 's/^/  /'
  report graph_launch_probe "$rc"
fi

exit 0
