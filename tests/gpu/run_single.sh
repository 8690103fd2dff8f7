#!/usr/bin/env bash
# Single-GPU mode (issue 7) on the GPU machine: the pinned staging feed and the allocator settings.
# Usage: bash tests/gpu/run_single.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/single.log; bench results in $OUT/bench_single/overlap/ and $OUT/bench_single/alloc/ (each
# single.md / single.jsonl, rewritten after every record, so a part cut short keeps what it measured).
# Prints one PASS/FAIL/SKIP line per check and exits 0. Each step is under `timeout`, capped (tests 60 s, overlap
# bench 45 s, allocator bench 45 s) and never past BUDGET (140 s) from the start, so the section ends within
# about 145 s (the -k kills only for a step that ignores SIGTERM); a step with no time left is a FAIL line.
. "$(dirname "$0")/common.sh" single "${1:-}"
BUDGET=140  # read by step (common.sh): no step runs past it

need_gpus 1 single

echo "== tests: stages 2/4 == 1 stage with the staging feed, stream overlap, async allocator + graph" >> "$LOG"
step "$OUT/single_tests.out" 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_single_gpu.py
rc=$?
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/single_tests.out" | tail -n 12 | sed 's/^/  /'
report tests "$rc"

bench_part() {  # bench_part PART NAME: one part of the single suite, its table, its PASS/FAIL line bench_NAME
  step "$OUT/bench_single_$2.out" 45 "$PY" -m peerline.bench.suites.single --part "$1" --out "$OUT/bench_single/$2"
  local rc=$?
  [ -f "$OUT/bench_single/$2/single.md" ] && cat "$OUT/bench_single/$2/single.md"
  report "bench_$2" "$rc"
}
echo "== bench: overlap vs serial vs bound" >> "$LOG"
bench_part overlap overlap
echo "== bench: caching vs async allocator (fresh processes)" >> "$LOG"
bench_part allocator alloc
if [ -f "$OUT/bench_single/overlap/single.jsonl" ]; then
  timeout -k 2 5 "$PY" - "$OUT/bench_single/overlap/single.jsonl" <<'PYEOF'
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
