"""ZB-V's rank orders as the zero-bubble paper constructs them (Qi et al., "Zero Bubble Pipeline Parallelism",
section 6), the order torch.distributed.pipelining's ScheduleZBVZeroBubble runs: --zb-order paper.

Rank r of pp holds chunk 0 = stage r and chunk 1 = stage 2pp-1-r (the V placement). Its order:
- warm-up: 2(pp-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); pp-r triples (F, B, W) of chunk 1;
- steady state: (F chunk 0 while any is left, B chunk 0, W chunk 0, F chunk 1, B chunk 1, W chunk 1) until both
  chunks have run every forward;
- cool-down: r pairs (B chunk 0, B chunk 1); pp-r pairs (B chunk 0, W chunk 0); then the deferred Ws of chunk 1,
  then those of chunk 0.
Every W follows its B within a few computes, so a rank holds at most 1F1B's activations (pp microbatches of each
chunk). Where M < 2pp-1 the pattern is built for 2pp-1 microbatches and the computes of the missing ones are left
out, as torch does.
"""

from __future__ import annotations

from peerline.distributed.pipeline.placement import V_SHAPE, Placement
from peerline.distributed.pipeline.schedule import ScheduleError

Compute = tuple[str, int, int]  # (op, stage, mb), as rank_schedule.Compute


def paper_orders(placement: Placement, m: int) -> list[list[Compute]]:
    """Every rank's (op, stage, mb) order of ZB-V by the paper's construction (module doc)."""
    if placement.shape != V_SHAPE or placement.per_rank != 2:
        raise ScheduleError("the paper's ZB-V order needs the V placement with two stages per rank")
    return [_rank_order(r, placement.pp, m) for r in range(placement.pp)]


def _rank_order(rank: int, pp: int, m: int) -> list[Compute]:
    chunk = (rank, 2 * pp - 1 - rank)
    n = max(2 * pp - 1, m)
    order: list[Compute] = []
    count = {(op, c): 0 for op in "FBW" for c in (0, 1)}

    def take(op: str, c: int) -> None:
        order.append((op, chunk[c], count[(op, c)]))
        count[(op, c)] += 1

    for _ in range(2 * (pp - rank) - 1):
        take("F", 0)
    for _ in range(rank):
        take("F", 1)
        take("F", 0)
    for _ in range(pp - rank):
        for op in "FBW":
            take(op, 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            take("F", 0)
        for c in (0, 1):
            if c == 1:
                take("F", 1)
            take("B", c)
            take("W", c)
    for _ in range(rank):
        take("B", 0)
        take("B", 1)
    for _ in range(pp - rank):
        take("B", 0)
        take("W", 0)
    for c in (1, 0):
        while count[("W", c)] < count[("B", c)]:
            take("W", c)
    return [(op, s, mb) for op, s, mb in order if mb < m]
