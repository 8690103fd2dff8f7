#!/usr/bin/env bash
# --graph-loop (issue 6: host time per iteration whatever the layer count): (a) the 1-GPU pytest checks (looped ==
# single replays bitwise, == eager 1e-6, two stages on one GPU, bf16 defaults); (b) with 2 GPUs, the launcher's
# runs: dp=2 (NCCL inside the loop) and pp=2 over NCCL looped against the same runs replaying one iteration per
# launch (bitwise; NCCL's collectives are refused today, see below), and pp=2 over the copy engine, whose flag waits
# cannot be looped: each must say why and still match. Logs to $OUT/graph_loop.log; one PASS/FAIL/SKIP line per check; exits 0. About 2 minutes.
. "$(dirname "$0")/common.sh" graph_loop "${1:-}"

need_gpus 1 graph_loop

echo "== looped graph vs single replays (pytest, 1 GPU)" >> "$LOG"
step "$OUT/graph_loop_tests.out" 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_graph_loop_gpu.py
rc=$?
report tests "$rc" "$(tail -n 1 "$OUT/graph_loop_tests.out" | tr -d '=' | sed 's/^ *//; s/ *$//')"

need_gpus 2 graph_loop.dp2 graph_loop.pp2_nccl graph_loop.pp2_copy_engine
D=$OUT/graph_loop; mkdir -p "$D"
# fp32, 14 iterations read every 4: 0-1 eager, 2-3 single replays, 4-11 two loops of 4, 12-13 single replays.
ARGS="--hidden 256 --layers 4 --seq 64 --micro-batch-size 2 -m 4 --iters 14 --warmup-iters 2 --log-every 4 --dtype fp32"
# CUDA_LOG_FILE: the driver's own error log (driver r575+) says why an instantiation is refused (pytorch#180960 saw
# "Device-launched graphs and conditional nodes do not support EVENT_WAIT nodes" there); the reason lands in the
# run's .out file.
run2() { step "$D/$1.out" 120 env CUDA_LOG_FILE=stderr ${RUN_ENV:-} torchrun --standalone --nproc_per_node=2 launch/pipeline.py $ARGS "${@:2}" --json "$D/$1.json"; }
pair() {  # pair NAME WANT ARGS...: looped and one-per-launch runs of the same grid, compared bitwise; WANT is the
  # iterations per launch the looped run must end up with (4, or 1 where the graph cannot be looped)
  local name=$1 want=$2; shift 2
  run2 "${name}_loop" "$@" --graph-loop 4
  run2 "${name}_plain" "$@" --graph-loop 1
  "$PY" tests/gpu/compare_runs.py "$D/${name}_loop.json" "$D/${name}_plain.json" --rtol 0 \
    --label "graph_loop.$name looped vs one launch per iteration (bitwise)"
  "$PY" - "$D/${name}_loop.json" "$name" "$want" <<'PYEOF' 2>>"$LOG" || echo "FAIL graph_loop.$name.loop_used (no result)"
import json, sys
path, name, want = sys.argv[1], sys.argv[2], sys.argv[3]
r = json.load(open(path))
ok = r["graph"] and (want == "any" or r["graph_loop"] == int(want))
tag = "INFO" if want == "any" else "PASS" if ok else "FAIL"
print(f"{tag} graph_loop.{name}.loop_used: graph {r['graph']}, iterations per launch {r['graph_loop']} (want "
      f"{want}); why not looped: {r['graph_loop_failed']}")
PYEOF
}
# NCCL collectives inside the loop body: refused by cudaGraphInstantiate on 2 x H200 / NCCL 2.28 (2026-11-26), even
# with the event nodes stood in (graph_loop.py); these check the refusal is clean and bitwise. Set 4 once it loops.
pair dp2 1 --pp 1 --dp 2
pair pp2_nccl 1 --pp 2 --p2p nccl --schedule 1f1b
pair pp2_copy_engine 1 --pp 2 --p2p copy-engine --schedule 1f1b
# Experiment (INFO only): NCCL_GRAPH_MIXING_SUPPORT=0 makes NCCL capture without its event-based strong streams
# (pytorch#180960); peerline issues no non-captured NCCL call on the dp / pp communicators between replays (the
# loss read uses the world group). GRAPH_LOOP_NOMIX=0 skips it.
if [ "${GRAPH_LOOP_NOMIX:-1}" = 1 ]; then
  RUN_ENV="NCCL_GRAPH_MIXING_SUPPORT=0" pair dp2_nomix any --pp 1 --dp 2
fi
grep -h "graph-loop" "$D"/*_loop.out | sort -u | sed 's/^/  /' | head -5
grep -h "\[CUDA\]\[E\]" "$D"/*_loop.out | sort -u | sed 's/^/  CUDA log: /' | head -8
exit 0
