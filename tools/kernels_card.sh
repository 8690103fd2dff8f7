#!/usr/bin/env bash
# One GPU, about 5 minutes: tune the kernels for this card (writes its entry of kernels/card_plans.json and
# OUT/tune.txt), then the kernel GPU tests and the hostcost bench suite through tools/gpu_checks.sh.
# Run it on an H100 and on an H200; commit kernels/card_plans.json from both (the second run keeps the first card's
# entry if the file was carried back).   OUT=<dir> bash tools/kernels_card.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/runs/kernels-card}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 240 python3 -m peerline.bench.kernel_tools.tune --sizes-mib "${TUNE_MIB:-1,4,16,64,256}" 2>&1 \
  | tee "$OUT/tune.txt"
cp kernels/card_plans.json "$OUT/card_plans.json"
TESTS="tests/gpu/test_kernels_launch_path.py tests/gpu/test_kernels_elementwise.py tests/gpu/test_fused_linear_gpu.py" \
  LIMIT=${LIMIT:-240} BENCH=hostcost BENCH_NPROC=1 BENCH_LIMIT=${BENCH_LIMIT:-120} bash tools/gpu_checks.sh "$@"
