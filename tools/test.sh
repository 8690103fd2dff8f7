#!/usr/bin/env bash
# The README's test command: install peerline with its test extras, check that mpirun starts (seconds, so a
# misconfigured MPI fails first, not after the long CPU tests), run the CPU tests (unit + multi-process on gloo),
# then the MPI integration tests under mpirun with pytest-mpi. GPU tests skip themselves without CUDA.
#   bash tools/test.sh              everything
#   bash tools/test.sh --preflight  only the environment and the mpirun check
set -euo pipefail
cd "$(dirname "$0")/.."

# Open MPI refuses to start as root unless told twice; containers and CI runners often are root.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
MPIRUN=(mpirun -n 2 --oversubscribe)

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
  preflight
  echo "tools/test.sh: mpirun and mpi4py work"
  exit 0
fi
python -m pip install -q -e '.[test]'
preflight
ruff check distributed kernels launch bench peerline tests
# Two workers (PEERLINE_TEST_WORKERS): a multi-process test spends most of its time waiting on its ranks. The
# reliability suite goes first, so its two minutes overlap the rest.
python -m pytest -q -p no:cacheprovider -n "${PEERLINE_TEST_WORKERS:-2}" --durations=15 \
    tests/reliability tests/unit tests/multiproc tests/gpu
"${MPIRUN[@]}" python -m pytest --with-mpi -q -p no:cacheprovider tests/integration
