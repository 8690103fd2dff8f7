# Sourced by every tests/gpu/run_<section>.sh:  . "$(dirname "$0")/common.sh" SECTION "${1:-}"
# Sets OUT (logs and results; argument, else $OUT, else /tmp/peerline-gpu), LOG ($OUT/SECTION.log, emptied), ROOT
# (the checkout, also the working directory) and PY, makes peerline importable, and defines
#   report NAME RC [DETAIL]   -> "PASS SECTION.NAME (DETAIL)" or "FAIL SECTION.NAME (rc RC, DETAIL, see LOG)"
# which run.sh collects, and step (below). Every section prints one such line per check and exits 0.
set -u
SECTION=$1
OUT="${2:-${OUT:-/tmp/peerline-gpu}}"
mkdir -p "$OUT"
LOG="$OUT/$SECTION.log"
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 0
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
# peerline/__init__.py maps the checkout's distributed/, kernels/, launch/ folders: the checkout on the path is all
# the install it needs (the GPU machine has no network for pip).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
: > "$LOG"

report() {  # report NAME RC [DETAIL]
  if [ "$2" -eq 0 ]; then echo "PASS $SECTION.$1${3:+ ($3)}"; else echo "FAIL $SECTION.$1 (rc $2${3:+, $3}, see $LOG)"; fi
}

# step OUTFILE CAP CMD...: run CMD under `timeout` for CAP seconds (or what is left of $BUDGET seconds since the
# section started, when BUDGET is set and less is left), its output in OUTFILE and appended to LOG; returns CMD's
# rc (124: timed out or no time left). One place for the bounding every section needs.
step() {
  local out=$1 cap=$2 rc
  shift 2
  if [ -n "${BUDGET:-}" ] && [ $((BUDGET - SECONDS)) -lt "$cap" ]; then cap=$((BUDGET - SECONDS)); fi
  if [ "$cap" -le 0 ]; then
    echo "no time left" > "$out"; rc=124
  else
    timeout -k 5 "$cap" "$@" > "$out" 2>&1
    rc=$?
  fi
  cat "$out" >> "$LOG"
  return "$rc"
}

# NGPU: CUDA devices this section sees. need_gpus N CHECK...: with fewer than N, one "SKIP CHECK" line per check and
# the section ends (exit 0, as every section does).
NGPU="$(timeout -k 2 30 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>>"$LOG" || echo 0)"
NGPU=${NGPU:-0}
need_gpus() {
  local n=$1 check
  shift
  [ "$NGPU" -ge "$n" ] && return 0
  for check in "$@"; do echo "SKIP $check (needs $n GPU(s), found $NGPU)"; done
  exit 0
}
