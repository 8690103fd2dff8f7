#!/usr/bin/env bash
# The README's test command: install peerline with its test extras, run the CPU tests (unit + multi-process on
# gloo), then the MPI integration tests under mpirun with pytest-mpi. GPU tests skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[test]'
ruff check distributed kernels launch bench peerline tests
python -m pytest -q -p no:cacheprovider tests/unit tests/multiproc tests/gpu
mpirun -n 2 --oversubscribe python -m pytest --with-mpi -q -p no:cacheprovider tests/integration
