#!/usr/bin/env bash
# Benchmark suite (issue 8) on the GPU machine: GPU checks of the timing pieces (CUDA-event timelines, block
# timer, stage times), then the full pipeline suite under torchrun on 2 GPUs: compute-bound and launch-bound
# configurations, 1F1B, peerline eager and graph against torch.distributed.pipelining, with the ideal time and a
# timeline (PNG + Chrome trace) of one eager iteration per configuration.
# Also the one-GPU graph suite (whole step graphed vs torch eager and vs a step captured by hand).
# Usage: bash tests/gpu/run_bench.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/bench.log; results under $OUT/bench_pipeline/ (results.jsonl, results.md, timeline-*.png/json),
# the timeline PNGs also copied to $OUT/. Prints one PASS/FAIL/SKIP line per check; exits 0.
# Bounded to 5 minutes (each step under `timeout`); a healthy run on 2 x H100 should take 2 to 3.
. "$(dirname "$0")/common.sh" bench "${1:-}"

need_gpus 1 bench

# (The timing-tool checks and the one-GPU graph suite are their own section: run_graph.sh.)

need_gpus 2 bench.pipeline

echo "== pipeline suite: compute-bound + launch-bound, 1F1B, torch / eager / graph, 2 ranks" >> "$LOG"
RES="$OUT/bench_pipeline"
timeout -k 10 185 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 launch/bench.py pipeline \
  --pipeline-configs compute,launch --schedules 1f1b --variants torch,eager,graph --pipeline-timeline \
  --pipeline-iters 5 --reps 5 --warmup 2 --out "$RES" > "$OUT/bench_pipeline.out" 2>&1
rc=$?
cat "$OUT/bench_pipeline.out" >> "$LOG"
grep -E "peerline-bench: |GOAL|ms/iter" "$OUT/bench_pipeline.out" | sed 's/^/  /' | tail -n 30
[ -f "$RES/results.md" ] && cat "$RES/results.md"
report pipeline_suite "$rc"

# Every record must be valid JSON with a finite ratio, and both configurations must have an eager record.
"$PY" - "$RES/results.jsonl" >> "$LOG" 2>&1 <<'PYEOF'
import json, math, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
assert recs, "no records"
bad = [r["case"] for r in recs if r["ratio"] is None or not math.isfinite(r["ratio"])]
assert not bad, f"non-finite ratios: {bad}"
cases = {r["case"] for r in recs}
for want in ("compute-bound 1f1b eager", "launch-bound 1f1b eager"):
    assert want in cases, f"missing {want}: {sorted(cases)}"
print("records ok:", len(recs), sorted(cases))
PYEOF
report pipeline_records "$?"

# The timeline: a Chrome trace per configuration (always), a PNG when matplotlib is installed, and the engine's
# spans consistent with the pipeline's dependencies (distributed/timeline_check.py).
traces=0
for f in "$RES"/timeline-*.png "$RES"/timeline-*.json; do
  [ -f "$f" ] || continue
  cp "$f" "$OUT/"
  case "$f" in *.json) traces=$((traces + 1)) ;; esac
done
ls "$RES"/timeline-*.png >/dev/null 2>&1 || echo "  (no timeline PNG: is matplotlib installed? the Chrome traces are there)"
grep -E "^- timeline" "$RES/results.md" 2>/dev/null | sed 's/^/  /'
if [ "$traces" -ge 2 ] && [ "$(grep -c "spans, consistent" "$RES/results.md" 2>/dev/null)" -ge 2 ]; then
  report timeline 0
else
  report timeline 1
fi
exit 0
