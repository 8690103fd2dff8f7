#!/usr/bin/env bash
# Copy-engine transport (issue 4) on the GPU machine: building blocks on one GPU, the transport on two GPUs under
# torchrun (every lane variant: 1 lane, 2 lanes round robin, 2 and 4 lanes split), then the p2p bench (the same
# variants next to raw cudaMemcpyPeerAsync, raw split over two streams, and NCCL, 64 KiB .. 256 MiB).
# Usage: bash tests/gpu/run_p2p.sh [OUT]   (or OUT=... in the environment; BUDGET=secs caps the whole section,
# default 120). Logs to $OUT/p2p.log, check output to $OUT/p2p_check.out, bench to $OUT/bench_p2p.out and
# $OUT/bench_p2p/ (p2p.jsonl, p2p.md). Prints one PASS/FAIL/SKIP line per check and the bench's GOAL MET/MISSED
# lines (16 MiB and up, per variant, vs raw and vs NCCL); always exits 0.
. "$(dirname "$0")/common.sh" p2p "${1:-}"
BUDGET="${BUDGET:-120}"

need_gpus 1 p2p

echo "== building blocks (1 GPU)" >> "$LOG"
# -v --timeout 40: a hung test is named, with its stack (pytest-timeout), before the step's own limit
step "$OUT/p2p_blocks.out" 55 "$PY" -m pytest -v -rA --timeout 40 --durations=0 -p no:cacheprovider -m gpu \
  tests/gpu/test_p2p_copy_engine.py -k "not two_gpus"
report building_blocks $? "$(tail -n 1 "$OUT/p2p_blocks.out")"
[ "${P2P_SELECT:-}" = blocks ] && exit 0  # P2P_SELECT=blocks: the one-GPU building blocks only

need_gpus 2 p2p.transport p2p.bench

echo "== transport checks (torchrun, 2 ranks)" >> "$LOG"
P2P_CHECK_TIMEOUT=45 step "$OUT/p2p_check.out" 50 "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node=2 tests/gpu/p2p_check.py
rc=$?
grep -E "^(PASS|FAIL) p2p\." "$OUT/p2p_check.out"
report transport "$rc"

echo "== bench (torchrun, 2 ranks)" >> "$LOG"
# The suite logs each size's GOAL lines as soon as the size is done: a bench cut short still reports them.
step "$OUT/bench_p2p.out" 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
  bench/suites/p2p.py --out "$OUT/bench_p2p" --reps 5
rc=$?
grep -E "^ *[0-9]+ [KM]iB  copy-engine|^graph:" "$OUT/bench_p2p.out"
grep -E "^GOAL" "$OUT/bench_p2p.out" || echo "GOAL MISSED p2p: no goal lines (bench did not reach 16 MiB, see $LOG)"
report bench "$rc"
exit 0
