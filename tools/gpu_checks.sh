#!/usr/bin/env bash
# GPU checks on the device machine: the tests/gpu pytest tests this machine's GPU count can run, then optionally
# benchmark suites. Usage: OUT=dir [LIMIT=s] [TESTS=paths] [BENCH="pipeline kernels"] bash tools/gpu_checks.sh [PYTEST ARGS]
#   e.g. bash tools/gpu_checks.sh -k "pipeline and not mpi"        TESTS=none BENCH=pipeline bash tools/gpu_checks.sh
# Knobs: OUT (default ./gpu-out), LIMIT (seconds for pytest, default 540), TESTS (default tests/gpu; none: no tests),
# BENCH (suites of launch/bench.py; none by default), BENCH_NPROC (ranks, default 2, 1 on one GPU), BENCH_ARGS,
# BENCH_LIMIT (seconds, default 300).
# $OUT keeps five files (the device tool returns at most 8): summary.txt, machine.txt, gpu-tests.xml (JUnit),
# bench.md, logs.tgz (pytest's log, every run's log and JSON, the bench's folder). Exit status: pytest's, else bench's.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
W=$OUT/w
mkdir -p "$W"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PEERLINE_GPU_OUT=$W/runs
# Wheels carried for what the GPU image lacks (pytest-timeout, pytest-mpi, rich, matplotlib): tests/gpu/README.md.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# `import peerline` works from the checkout itself (peerline/__init__.py maps the sibling folders): no build step.
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version(), "cupy", cupy.__version__)'
  nvidia-smi topo -m
} > "$OUT/machine.txt" 2>&1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
case ${NGPU:-0} in  # every test a machine of this size can run; the larger grids are deselected, not skipped
  0|1) MARKERS="gpu and not gpu2 and not gpu4" ;;
  2|3) MARKERS="gpu and not gpu4" ;;
  *) MARKERS="gpu" ;;
esac
rc=0
: > "$OUT/summary.txt"
if [ "${TESTS:-}" != none ]; then
  t0=$SECONDS
  # shellcheck disable=SC2086 # TESTS is a list of paths
  # In a session of its own (setsid), so the cleanup below ends this run's processes and not those of a second
  # gpu_checks.sh running beside it on other GPUs (CUDA_VISIBLE_DEVICES=2,3).
  setsid timeout -k 15 "${LIMIT:-540}" python3 -m pytest ${TESTS:-tests/gpu} -m "$MARKERS" -p no:cacheprovider \
    -rfEs --durations=20 --junitxml="$OUT/gpu-tests.xml" "$@" > "$W/pytest.log" 2>&1 &
  sid=$!
  wait "$sid"
  rc=$?
  # A test cut by LIMIT leaves its ranks holding GPU memory and cores; end them before anything else runs on this
  # host. tests/gpu/jobs.py starts each job in a session of its own, so they are found by the PEERLINE_GPU_OUT
  # this run gave them, not by pytest's session.
  pkill -9 -s "$sid" 2>/dev/null
  for env in /proc/[0-9]*/environ; do
    if { tr '\0' '\n' < "$env"; } 2>/dev/null | grep -qxF "PEERLINE_GPU_OUT=$W/runs"; then
      pid=${env#/proc/}; kill -9 "${pid%/environ}" 2>/dev/null
    fi
  done
  { echo "gpu_checks: $NGPU GPU(s); pytest -m \"$MARKERS\" $*: exit status $rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 124 ] && echo "pytest ran past LIMIT=${LIMIT:-540} s (w/pytest.log in logs.tgz)"
    # A cut run has no summary of its own: the failures tests/gpu/conftest.py wrote as they happened.
    [ "$rc" -eq 124 ] && [ -s "$W/runs/failures.txt" ] && { echo "failures before the cut:"; tail -n 60 "$W/runs/failures.txt"; }
    if grep -q "short test summary info" "$W/pytest.log"; then sed -n '/short test summary info/,$p' "$W/pytest.log"
    else tail -n 15 "$W/pytest.log"; fi | head -n 60
    # Each failure's message (its last lines), so a summary alone says why without unpacking logs.tgz.
    python3 - "$OUT/gpu-tests.xml" <<'PY' 2>/dev/null
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    for bad in case:
        if bad.tag in ("failure", "error"):
            print(f"--- {case.get('name')} ({bad.tag}):\n" + "\n".join((bad.text or "").splitlines()[-25:]))
PY
  } >> "$OUT/summary.txt"
fi
if [ -n "${BENCH:-}" ]; then
  np=${BENCH_NPROC:-$((NGPU < 2 ? 1 : 2))}
  t0=$SECONDS
  # shellcheck disable=SC2086 # BENCH and BENCH_ARGS are lists
  timeout -k 15 "${BENCH_LIMIT:-300}" python3 -m torch.distributed.run --standalone --nproc_per_node="$np" \
    launch/bench.py $BENCH --out "$W/bench" ${BENCH_ARGS:-} > "$W/bench.log" 2>&1
  brc=$?
  { echo "bench $BENCH on $np rank(s): exit status $brc in $((SECONDS - t0)) s"
    grep -E "^(GOAL|SWEEP)|peerline-bench: " "$W/bench.log" | tail -n 40; } >> "$OUT/summary.txt"
  cp "$W/bench/results.md" "$OUT/bench.md" 2>/dev/null
  [ "$rc" -eq 0 ] && rc=$brc
fi
# Logs only: files over 2 MiB (checkpoints, traces) stay behind, so the archive stays under the device tool's
# 16 MiB a file and comes back.
( cd "$OUT" && find w -type f -size +2M > "$OUT/.big" && tar -czf logs.tgz -X .big w; rm -f .big ) && rm -rf "$W"
cat "$OUT/summary.txt"
exit "$rc"
