#!/usr/bin/env bash
# Compare the benchmarks of two checkouts on the same machine, in one run: the pipeline suite (2 GPUs) and the
# kernels suite (1 GPU), each run from BASE then from this checkout, alternating for ROUNDS rounds, so both sides
# see the same cards, clocks and neighbours. Results: $OUT/ab/<side><round>-<suite>/results.{md,jsonl}, and
# $OUT/ab/summary.md with every side's ratios next to each other.
#
#   BASE=/path/to/other/checkout OUT=/some/dir [ROUNDS=1] [SUITES="pipeline kernels"] bash tools/bench_ab.sh
set -u
NEW=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:?BASE=<the other checkout>}
BASE=$(cd "$BASE" && pwd)
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT/ab"
PY=${PY:-python3}

run_suite() {  # SIDE_DIR LABEL SUITE
  local dir=$1 label=$2 suite=$3 res="$OUT/ab/$2-$3"
  echo "== $label $suite ($(date +%T))"
  case $suite in
    pipeline)
      (cd "$dir" && PYTHONPATH=$dir:${SITE:-} timeout -k 10 240 "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute,launch --schedules 1f1b \
        --variants torch,eager,graph --pipeline-iters 5 --reps 5 --warmup 2 --out "$res") ;;
    kernels)
      (cd "$dir" && PYTHONPATH=$dir:${SITE:-} timeout -k 10 150 "$PY" launch/bench.py kernels \
        --kernel-sizes-mib 16,256 --reps 20 --out "$res") ;;
  esac > "$res.log" 2>&1
  echo "   rc=$? $(grep -c . "$res/results.jsonl" 2>/dev/null || echo 0) records"
}

for round in $(seq 1 "${ROUNDS:-1}"); do
  for suite in ${SUITES:-pipeline kernels}; do
    run_suite "$BASE" "base$round" "$suite"
    run_suite "$NEW" "new$round" "$suite"
  done
done

"$PY" - "$OUT/ab" > "$OUT/ab/summary.md" <<'PYEOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(root.glob("*/results.jsonl")):
    side = f.parent.name
    for line in f.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault((r["suite"], r["case"], r["metric"]), {})[side] = (r["peerline"], r["anchor"], r["ratio"])
sides = sorted({s for v in rows.values() for s in v})
print("| suite | case | metric | " + " | ".join(f"{s} peerline | {s} anchor | {s} ratio" for s in sides) + " |")
print("| --- | --- | --- | " + " | ".join("---: | ---: | ---:" for _ in sides) + " |")
for (suite, case, metric), v in rows.items():
    cells = []
    for s in sides:
        p, a, r = v.get(s, (float("nan"),) * 3)
        cells.append(f"{p:.4g} | {a:.4g} | {r:.3f}" if r is not None else f"{p} | {a} | -")
    print(f"| {suite} | {case} | {metric} | " + " | ".join(cells) + " |")
PYEOF
cat "$OUT/ab/summary.md"
