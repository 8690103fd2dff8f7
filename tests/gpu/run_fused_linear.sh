#!/usr/bin/env bash
# Fused linear (gradient-accumulation fusion, kernels/fused_linear.py) on one GPU: the addmm.dtype_out probe,
# bf16 gradients against float64, hooks, CUDA-graph replay vs eager (pytest), then one stage's forward+backward
# timing, nn.Linear vs fused (8 blocks of h=2048, M=8 x 8x512, bf16).
# Usage: bash tests/gpu/run_fused_linear.sh [OUT]   (or OUT=... in the environment)
# Logs to $OUT/fused_linear.log. Prints one PASS/FAIL/SKIP/GOAL line per check and exits 0. Within BUDGET (100 s);
# a healthy run takes about 40 s.
. "$(dirname "$0")/common.sh" fused_linear "${1:-}"
BUDGET=100  # read by step (common.sh): no step runs past it

need_gpus 1 fused_linear

echo "== tests: probe, bf16 grads vs float64, hooks, graph replay vs eager" >> "$LOG"
step "$OUT/fused_linear_tests.out" 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE \
  tests/gpu/test_fused_linear_gpu.py
rc=$?
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/fused_linear_tests.out" | tail -n 12 | sed 's/^/  /'
report tests "$rc"

echo "== bench: one stage fwd+bwd, nn.Linear vs fused" >> "$LOG"
step "$OUT/fused_linear_bench.out" 40 "$PY" tests/gpu/fused_linear_bench.py
rc=$?
grep -E "^(PASS|FAIL|GOAL|INFO)" "$OUT/fused_linear_bench.out"
report bench "$rc"
exit 0
