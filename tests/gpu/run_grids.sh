#!/usr/bin/env bash
# Issue 11 on 4 GPUs: the pp=2 x dp=2 and pp=4 grids, 1F1B, copy-engine P2P (the GPU default).
#  check: fp32 runs of a tiny 8-layer model, graph on and off, each against the single-GPU run of the same model
#         and seed (1e-5 relative, as run_pipeline.sh; dp=2 against one GPU with dp x the microbatches), and the
#         README default (bf16, graphs) on 4 ranks against one GPU (2e-2). The one-GPU references run side by side,
#         one GPU each. tests/gpu/grids_compare.py also checks that graph runs really were captured, that the
#         transport is the copy engine and that every replica reports every layer.
#  bench: the pipeline suite (torch / eager / graph, 1F1B, timelines) on 4 ranks as pp=2 x dp=2 and as pp=4, short
#         settings; results under $OUT/bench_grids_pp2dp2 and $OUT/bench_grids_pp4; GOAL and GOAL-INFO lines
#         (throughput vs torch, distance to the ideal time) for run.sh's summary.
# Usage: OUT=... bash tests/gpu/run.sh grids:270     (or: bash tests/gpu/run_grids.sh [OUT])
# Knobs: GRIDS_SELECT=check,bench (default both); GRIDS_BUDGET (seconds for the whole section, default 240: every
# step is cut to what is left); GRIDS_BENCH_CONFIGS (default compute,launch); GRIDS_FAKE_CPU=1 runs the same
# commands on the CPU with gloo (PEERLINE_DEVICE=cpu, the bench on the `quick` configuration) to check the script
# itself on a machine without GPUs. Logs to $OUT/grids.log; one PASS/FAIL/SKIP line per check; exits 0.
# shellcheck source=tests/gpu/common.sh
. "$(dirname "$0")/common.sh" grids "${1:-}"

SELECT=${GRIDS_SELECT:-check,bench}
BUDGET=${GRIDS_BUDGET:-240}
CONFIGS=${GRIDS_BENCH_CONFIGS:-compute,launch}
GPU_EXPECT=1  # on GPUs: graph runs must really be graphs, the transport the copy engine
if [ -n "${GRIDS_FAKE_CPU:-}" ]; then
  export PEERLINE_DEVICE=cpu OMP_NUM_THREADS=1
  NGPU=4 GPU_EXPECT="" CONFIGS=${GRIDS_BENCH_CONFIGS:-quick}
  echo "GRIDS_FAKE_CPU: the GPU commands on the CPU (gloo); graph and transport expectations off"
fi
want() { case ",$SELECT," in *",$1,"*) return 0 ;; esac; return 1; }

checks=()
want check && checks+=(grids.ref_graph_vs_eager grids.pp2dp2_graph grids.pp2dp2_no_graph grids.pp4_graph grids.pp4_no_graph grids.default_bf16)
want bench && checks+=(grids.bench_pp2dp2 grids.bench_pp4)
need_gpus 4 "${checks[@]}"

TINY=(--hidden 256 --layers 8 --seq 64 --micro-batch-size 2 --iters 5 --warmup-iters 2 --schedule 1f1b)
PL=launch/pipeline.py
D="$OUT/grids"
# No result of an earlier call in the same OUT may stand in for a run that failed this time.
rm -rf "$D" "$OUT"/bench_grids_pp2dp2 "$OUT"/bench_grids_pp4
mkdir -p "$D"
# Arrays, not functions: step runs its command under `timeout`, which cannot call shell functions.
RUN4=("$PY" -m torch.distributed.run --standalone --nproc_per_node=4)

# compare NAME RESULT REFERENCE RTOL DP GRAPH(on|off|"") : one PASS/FAIL line from grids_compare.py's verdict
compare() {
  local name=$1 res=$2 ref=$3 rtol=$4 dp=$5 graph=$6 detail rc
  local expect=()
  if [ -n "$GPU_EXPECT" ]; then
    expect=(--transport copy-engine)
    [ -n "$graph" ] && expect+=(--graph "$graph")
  fi
  detail=$("$PY" tests/gpu/grids_compare.py run "$res" "$ref" --rtol "$rtol" --world 4 --dp "$dp" "${expect[@]}" 2>&1)
  rc=$?
  echo "$name: $detail" >> "$LOG"
  report "$name" "$rc" "$detail"
}

if want check; then
  echo "== check: one-GPU references (fp32 M=8 eager and graph, bf16 README default), side by side" >> "$LOG"
  # Both grids use 8 microbatches per iteration in all: pp=2 x dp=2 runs M=4 per replica, pp=4 runs M=8.
  step "$D/ref8.log" 150 env CUDA_VISIBLE_DEVICES=0 "$PY" $PL "${TINY[@]}" --dtype fp32 --no-graph -m 8 --json "$D/ref8.json" & p1=$!
  step "$D/ref8g.log" 150 env CUDA_VISIBLE_DEVICES=1 "$PY" $PL "${TINY[@]}" --dtype fp32 --graph -m 8 --json "$D/ref8g.json" & p2=$!
  step "$D/default1.log" 150 env CUDA_VISIBLE_DEVICES=2 "$PY" $PL --iters 6 --json "$D/default1.json" & p3=$!
  wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?
  echo "references: rc $r1 (fp32 eager) $r2 (fp32 graph) $r3 (bf16 default)" >> "$LOG"
  # The one-GPU graph run against the eager one: if this fails, the grid graph runs' failures are not the grid's.
  "$PY" tests/gpu/compare_runs.py "$D/ref8g.json" "$D/ref8.json" --rtol 1e-6 --label "1 GPU graph vs eager fp32 M=8" \
    >> "$LOG" 2>&1
  report ref_graph_vs_eager $? "1 GPU, the references' own consistency"
  for g in graph no-graph; do
    gflag=on; [ $g = no-graph ] && gflag=off
    n=pp2dp2_${g//-/_}
    echo "== check: pp=2 x dp=2 $g" >> "$LOG"
    step "$D/$n.log" 100 "${RUN4[@]}" $PL "${TINY[@]}" --pp 2 --dp 2 --dtype fp32 -m 4 --p2p copy-engine --$g \
      --json "$D/$n.json"
    rc=$?
    if [ $rc -ne 0 ]; then report "$n" $rc "the run failed: $(tail -1 "$D/$n.log")"; else
      compare "$n" "$D/$n.json" "$D/ref8.json" 1e-5 2 "$gflag"; fi
    n=pp4_${g//-/_}
    echo "== check: pp=4 $g" >> "$LOG"
    step "$D/$n.log" 100 "${RUN4[@]}" $PL "${TINY[@]}" --pp 4 --dtype fp32 -m 8 --p2p copy-engine --$g --json "$D/$n.json"
    rc=$?
    if [ $rc -ne 0 ]; then report "$n" $rc "the run failed: $(tail -1 "$D/$n.log")"; else
      compare "$n" "$D/$n.json" "$D/ref8.json" 1e-5 1 "$gflag"; fi
  done
  # The README's command with its defaults (bf16, graphs, copy engine, peerline kernels) on 4 ranks: pp=4.
  echo "== check: README default on 4 ranks" >> "$LOG"
  step "$D/default4.log" 100 "${RUN4[@]}" $PL --iters 6 --json "$D/default4.json"
  rc=$?
  if [ $rc -ne 0 ]; then report default_bf16 $rc "the run failed: $(tail -1 "$D/default4.log")"; else
    compare default_bf16 "$D/default4.json" "$D/default1.json" 2e-2 1 on; fi
fi

# bench_grid NAME DP: the pipeline suite on 4 ranks as pp=(4/DP) x dp=DP
bench_grid() {
  local name=$1 dp=$2 res="$OUT/bench_grids_$1" rc variants=torch,eager,graph peer=eager,graph
  [ -n "${GRIDS_FAKE_CPU:-}" ] && peer=eager  # no graphs on the CPU: the suite skips that variant
  echo "== bench: pipeline suite, $name (dp=$dp), configs $CONFIGS" >> "$LOG"
  step "$OUT/bench_grids_$name.out" 150 "${RUN4[@]}" launch/bench.py pipeline --pipeline-configs "$CONFIGS" \
    --schedules 1f1b --variants $variants --pipeline-timeline --dp "$dp" --pipeline-iters 3 --reps 3 --warmup 1 \
    --out "$res"
  rc=$?
  [ -f "$res/results.md" ] && cat "$res/results.md" >> "$LOG"
  # The suite's own goal verdicts (graph vs torch), tagged with the grid; then one GOAL-INFO line per record.
  grep -hoE "GOAL (MET|MISSED) .*" "$res/results.md" 2>/dev/null | sed "s/\$/ [grid $name]/"
  local grid="pp=$((4 / dp)) x dp=$dp" ncfg traces consistent
  "$PY" tests/gpu/grids_compare.py bench "$res/results.jsonl" --grid "$grid" --configs "$CONFIGS" \
    --variants "$peer" > "$OUT/bench_grids_$name.check" 2>&1
  local rec=$?
  cat "$OUT/bench_grids_$name.check" >> "$LOG"
  grep -E "^GOAL-INFO" "$OUT/bench_grids_$name.check"
  # Timelines: one Chrome trace per configuration, each "consistent" (distributed/timeline_check.py).
  ncfg=$(echo "$CONFIGS" | tr ',' '\n' | grep -c .)
  traces=$(find "$res" -maxdepth 1 -name 'timeline-*.json' 2>/dev/null | wc -l)
  consistent=$(grep -c "spans, consistent" "$res/results.md" 2>/dev/null)
  ls "$res"/timeline-*.png >/dev/null 2>&1 || echo "  (no timeline PNG under $res: matplotlib missing?)" >> "$LOG"
  local fail=0 why=""
  consistent=${consistent:-0}
  if [ "$rc" -eq 124 ]; then fail=124; why="suite timed out (or no time left)"
  elif [ "$rc" -ne 0 ]; then fail=$rc; why="suite rc $rc: $(grep -E "Error|error" "$OUT/bench_grids_$name.out" | tail -1)"
  fi
  if [ "$rec" -ne 0 ]; then
    [ "$fail" -eq 0 ] && fail=1
    why="${why:+$why; }records: $(grep FAIL-DETAIL "$OUT/bench_grids_$name.check")"
  fi
  if [ "$traces" -lt "$ncfg" ] || [ "$consistent" -lt "$ncfg" ]; then
    [ "$fail" -eq 0 ] && fail=1
    why="${why:+$why; }timelines: $traces traces, $consistent consistent of $ncfg configurations"
  fi
  report "bench_$name" "$fail" "$grid, $CONFIGS, results in $res${why:+; $why}"
}

if want bench; then
  bench_grid pp2dp2 2
  bench_grid pp4 1
fi
echo "grids section: $SECONDS s" >> "$LOG"
exit 0
