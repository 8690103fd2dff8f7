#!/usr/bin/env bash
# The README's test command, in phases; each runs whatever happened before it, and the script ends with a table of
# every phase's result and time, exit 1 when any phase failed:
#   install   pip install -e '.[test]' (peerline, its test tools, Open MPI and mpi4py)
#   mpirun    mpirun starts 2 processes with mpi4py (seconds, so a broken MPI shows before the long tests)
#   lint      ruff check
#   cpu       the CPU tests: reliability, unit, multi-process (gloo), GPU tests (they skip without CUDA)
#   mpi       the MPI integration tests under mpirun with pytest-mpi (skipped, saying so, when mpirun failed)
#
#   bash tools/test.sh                 every phase
#   bash tools/test.sh lint cpu        only these phases, in this order
#   bash tools/test.sh --preflight     only the mpirun check
#
# Load: every test process runs torch on one thread (tests/conftest.py; OpenMP threads that spin on a shared
# 2-core machine made single tests 15x slower), and each test's timeout grows with the machine's load
# (tests/timeouts.py; PEERLINE_TEST_TIMEOUT_SCALE sets the factor). PEERLINE_TEST_WORKERS: pytest-xdist workers
# of the cpu phase (default 3).
set -uo pipefail
cd "$(dirname "$0")/.."

# Open MPI refuses to start as root unless told twice; containers and CI runners often are root.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MPIRUN=(mpirun -n 2 --oversubscribe)
ALL_PHASES=(install mpirun lint cpu mpi)

preflight() {
  if ! command -v mpirun >/dev/null; then
    echo "tools/test.sh: mpirun not found: pip install -e '.[test]' brings Open MPI (or install it)" >&2
    return 1
  fi
  if ! out=$("${MPIRUN[@]}" python -c "import mpi4py.MPI as M; assert M.COMM_WORLD.Get_size() == 2" 2>&1); then
    echo "tools/test.sh: mpirun cannot start 2 processes with mpi4py:" >&2
    echo "$out" | tail -n 5 >&2
    return 1
  fi
}

if [ "${1:-}" = "--preflight" ]; then
  preflight || exit 1
  echo "tools/test.sh: mpirun and mpi4py work"
  exit 0
fi

describe() {
  case $1 in
    install) echo "pip install -e '.[test]'" ;;
    mpirun) echo "mpirun starts 2 processes with mpi4py" ;;
    lint) echo "ruff check distributed kernels launch bench peerline tests" ;;
    cpu) echo "pytest -n ${PEERLINE_TEST_WORKERS:-3}: tests/reliability tests/unit tests/multiproc tests/gpu" ;;
    mpi) echo "${MPIRUN[*]} pytest --with-mpi tests/integration" ;;
  esac
}

phase_install() { python -m pip install -q -e '.[test]'; }
phase_mpirun() { preflight && echo "tools/test.sh: mpirun and mpi4py work"; }
phase_lint() { ruff check distributed kernels launch bench peerline tests; }
# Three workers on 2 cores: a multi-process test spends part of its time waiting (deadlines, hang cases, rendezvous),
# and with two workers those waits left the cores idle a fifth of the phase (busy 80 %; 93 % with three). The slow
# tests go first (tests/conftest.py) and an idle worker takes queued tests from a busy one (--dist worksteal), so the
# long ones overlap the rest instead of one worker running them alone at the end.
phase_cpu() {
  python -m pytest -q -p no:cacheprovider -n "${PEERLINE_TEST_WORKERS:-3}" --dist worksteal --durations=15 \
      tests/reliability tests/unit tests/multiproc tests/gpu
}
phase_mpi() { "${MPIRUN[@]}" python -m pytest --with-mpi -q -p no:cacheprovider tests/integration; }

declare -A RESULT SECONDS_OF
FAILED=0
run_phase() {  # name
  local name=$1 start rc
  if [ "$name" = mpi ] && [ "${RESULT[mpirun]:-}" != "" ] && [ "${RESULT[mpirun]}" != passed ]; then
    RESULT[mpi]="skipped: mpirun does not work (see the mpirun phase)"
    SECONDS_OF[mpi]=0
    FAILED=1
    echo "tools/test.sh: phase mpi skipped: mpirun does not work (see the mpirun phase)" >&2
    return
  fi
  echo "tools/test.sh: phase $name: $(describe "$name")"
  start=$(date +%s)
  "phase_$name"
  rc=$?
  SECONDS_OF[$name]=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then
    RESULT[$name]=passed
  else
    RESULT[$name]="FAILED (exit $rc)"
    FAILED=1
  fi
  echo "tools/test.sh: phase $name ${RESULT[$name]} in ${SECONDS_OF[$name]} s"
}

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=("${ALL_PHASES[@]}")
for name in "${phases[@]}"; do
  if ! declare -F "phase_$name" >/dev/null; then
    echo "tools/test.sh: no phase '$name'; the phases: ${ALL_PHASES[*]}" >&2
    exit 2
  fi
done
total_start=$(date +%s)
for name in "${phases[@]}"; do
  run_phase "$name"
done
load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo "?")  # not nproc: it counts OMP_NUM_THREADS
echo
echo "tools/test.sh: summary ($(( $(date +%s) - total_start )) s; load average $load on $cores cores)"
for name in "${phases[@]}"; do
  printf '  %-8s %6s s  %s\n' "$name" "${SECONDS_OF[$name]}" "${RESULT[$name]}"
done
exit $FAILED
