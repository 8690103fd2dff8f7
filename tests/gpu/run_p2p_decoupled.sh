#!/usr/bin/env bash
# Copy-engine "decoupled flags" (issue 4), focused: only the decoupled transport checks of tests/gpu/p2p_check.py,
# then the p2p bench at 4 .. 256 MiB with the runtime default (2 lanes), 1 lane and the two decoupled variants
# next to raw cudaMemcpyPeerAsync and NCCL. Not in run.sh's default list: `OUT=... bash tests/gpu/run.sh
# p2p_decoupled:150`. Logs to $OUT/p2p_decoupled.log; one PASS/FAIL line per check, the bench's size lines and
# GOAL lines; always exits 0. P2P_VARIANTS / P2P_SIZES (KiB, comma separated) override the bench's choice.
. "$(dirname "$0")/common.sh" p2p_decoupled "${1:-}"
BUDGET="${BUDGET:-150}"

need_gpus 2 p2p_decoupled.transport p2p_decoupled.bench

echo "== decoupled transport checks (torchrun, 2 ranks)" >> "$LOG"
P2P_CHECK_ONLY=decoupled P2P_CHECK_TIMEOUT=55 step "$OUT/p2p_decoupled_check.out" 60 "$PY" \
  -m torch.distributed.run --standalone --nproc_per_node=2 tests/gpu/p2p_check.py
rc=$?
grep -E "^(PASS|FAIL) p2p\." "$OUT/p2p_decoupled_check.out"
report transport "$rc"

echo "== bench (torchrun, 2 ranks)" >> "$LOG"
P2P_VARIANTS="${P2P_VARIANTS:-1 lane,2 lanes,decoupled,decoupled 2 lanes}" step "$OUT/bench_p2p_decoupled.out" 80 \
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 bench/suites/p2p.py \
  --out "$OUT/bench_p2p_decoupled" --reps 5 --sizes "${P2P_SIZES:-4096,16384,65536,262144}"
rc=$?
grep -E "^ *[0-9]+ [KM]iB  copy-engine|^graph:" "$OUT/bench_p2p_decoupled.out"
grep -E "^GOAL" "$OUT/bench_p2p_decoupled.out" || echo "GOAL MISSED p2p: no goal lines (see $LOG)"
report bench "$rc"
exit 0
