"""Schedules of several stages per rank, as each rank's program: interleaved 1F1B, ZB-V and interleaved zero bubble.

A rank program is a list of (stage, step): a compute step of one of its stages, or a group of communication
actions posted together, each action naming its stage (`Action.stage`). For a rendezvous transport, between two
computes of a rank one group holds the sends of the first and the receives of the second, whichever stages they
belong to: the pattern that keeps two ranks that send to each other from deadlocking (Megatron posts the same
pairs together). For the copy engine, each receive is posted alone just before its consumer (`with_rank_messages`).
Messages between two stages of one rank stay in the program (the engine hands them over by a stream wait) and
cost nothing.

  interleaved  Megatron's virtual pipeline: rank r holds stages r, r+pp, ...; forwards go chunk by chunk over
               groups of pp microbatches (so M must be a multiple of pp), backwards the same in reverse chunk
               order; (pp - r - 1) * 2 + (V - 1) * pp warm-up forwards, then one forward / one backward.
  zbv          the V placement (placement.py) with the backward split into B and W (split_backward.py), its
               order found by list scheduling (`zero_bubble_orders`): a ready B first, then a ready F while the rank
               holds fewer than 2pp microbatches' activations (1F1B's memory), the deferred Ws in the gaps;
               --zb-memory 1f1b counts the deferred Ws too and plans with B longer than W (PLAN_COSTS);
               --zb-order searched improves either order (order_search.py); --zb-order paper takes the
               paper's construction instead (zbv_paper.py).
  zb-interleaved  the loop placement of interleaved with the backward split as zbv's, V stages per rank: the
               same list scheduling (`zero_bubble_orders`); more stages per rank shorten the warm-up each rank
               waits through (in unit time at pp=4, M=8: 0.970 of the bubble-free time with 4 stages per rank
               against ZB-V's 0.941), for V times the messages.
"""

from __future__ import annotations

from collections.abc import Callable

from peerline.distributed.pipeline.placement import LOOP, V_SHAPE, Placement
from peerline.distributed.pipeline.schedule import Action, ScheduleError, Step
from peerline.distributed.pipeline.timed import dependency, is_ready

Compute = tuple[str, int, int]  # (op, stage, mb)
RankProgram = list[tuple[int, Step]]
RANK_SCHEDULES = ("interleaved", "zbv", "zb-interleaved")


def interleaved_order(rank: int, pp: int, v: int, m: int) -> list[Compute]:
    """Megatron's interleaved 1F1B order of one rank's computes."""
    if m % pp:
        raise ScheduleError(f"interleaved needs the microbatches in groups of pp: M={m} is not a multiple of "
                            f"pp={pp} (use --microbatches {(m // pp + 1) * pp})")
    total = m * v

    def virtual(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (chunk if forward else v - 1 - chunk) * pp + rank, (k // (pp * v)) * pp + k % pp

    warmup = total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order: list[Compute] = [("F", *virtual(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order += [("F", *virtual(warmup + i, True)), ("B", *virtual(i, False))]
    return order + [("B", *virtual(k, False)) for k in range(total - warmup, total)]


def _pick(stages: list[int], nxt: dict, pending_w: list, n: int, m: int, done: dict, t: float,
          f_limit: int, hold: bool = False, relax: bool = False) -> Compute | None:
    """What a free rank starts at t: a ready B (oldest microbatch, the later stage first), a ready F under the
    activation limit (the later stage first: a microbatch's forward finishes before the next starts), a W. With
    `hold`, the deferred Ws count toward that limit. `relax`: the last stage's F may pass the limit (its B follows
    at once and frees it), for the moment when no rank could start anything otherwise."""
    if len(pending_w) >= f_limit:
        return ("W", *pending_w[0])
    bs = [("B", s, nxt[("B", s)]) for s in stages if nxt[("B", s)] < nxt[("F", s)]]
    bs = [c for c in bs if is_ready(*c, n, done, t)]
    if bs:
        return min(bs, key=lambda c: (c[2], -c[1]))
    in_flight = sum(nxt[("F", s)] - nxt[("B", s)] for s in stages)
    fs = [("F", s, nxt[("F", s)]) for s in stages if nxt[("F", s)] < m]
    fs = [c for c in fs if is_ready(*c, n, done, t)]
    if in_flight + (len(pending_w) if hold else 0) >= f_limit:
        fs = [c for c in fs if c[1] == n - 1] if relax else []
    if fs:
        return min(fs, key=lambda c: (c[2], -c[1]))
    return ("W", *pending_w[0]) if pending_w else None


#: (F, B, W) times the --zb-memory 1f1b order is planned with and judged by: unit time, and B longer than W as
#: the lean weight pass makes them (B: the input-gradient GEMMs and the elementwise backward; W: the weight GEMMs)
PLAN_COSTS = ((1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.3, 0.7), (1.0, 1.4, 0.6))
JUDGE_COSTS = ((1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.3, 0.7), (1.0, 1.1, 1.0))


def zero_bubble_orders(placement: Placement, m: int, memory: str = "fast") -> list[list[Compute]]:
    """Every rank's (op, stage, mb) order for a zero-bubble schedule of several stages per rank (zbv on the V,
    zb-interleaved on the loop) by list scheduling (`list_orders`). A rank may hold V x pp stage-microbatches'
    activations (1F1B's peak). "fast" plays it in unit time. "1f1b" counts the deferred Ws among them; a hold cap
    played in unit time stalls forwards once B outlasts W, so the capped order is planned under each of PLAN_COSTS
    and the one with the least mean makespan over JUDGE_COSTS is kept. Deterministic, so every rank gets the same
    order. "fast" stays in unit time: planned under those costs, ZB-V is slower on GPUs (code-notes.md).
    (order_search.py may improve either order: --zb-order searched.)"""
    if memory != "1f1b":
        return list_orders(placement, m, hold=False)
    plans = [list_orders(placement, m, hold=True, costs=plan) for plan in PLAN_COSTS]
    # rounded: orders whose makespans differ only in float rounding tie, and the first plan's wins
    return min(plans, key=lambda orders: round(sum(makespan(orders, placement.n_stages, judge)
                                                   for judge in JUDGE_COSTS), 6))


def makespan(orders: list[list[Compute]], n_stages: int, costs: tuple[float, float, float],
             transfer: float = 0.0) -> float:
    """When the last compute of `orders` ends, F, B and W taking `costs` (an input from another rank arriving
    `transfer` after its producer ends)."""
    by_op = dict(zip("FBW", costs, strict=True))
    return max(end for _, end in compute_times(orders, n_stages, lambda op, _s: by_op[op], transfer).values())


def list_orders(placement: Placement, m: int, hold: bool,
                costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[list[Compute]]:
    """Zero-bubble orders by list scheduling, F, B and W taking `costs`: whenever a rank is free it starts a ready
    B (oldest microbatch, the later stage first), else a ready F while it holds fewer than V x pp microbatches'
    activations (`hold`: its deferred Ws counted too), else its oldest deferred W; time moves to the next end.
    Where every rank is idle and none can start, the last stage's F passes the limit (`_pick`'s relax)."""
    n, pp = placement.n_stages, placement.pp
    cost = dict(zip("FBW", costs, strict=True))
    ranks = [placement.stages_of(r) for r in range(pp)]
    nxt = {(op, s): 0 for s in range(n) for op in ("F", "B")}
    pending: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    orders: list[list[Compute]] = [[] for _ in range(pp)]
    done: dict[Compute, float] = {}
    busy, t, steps, relax = [0.0] * pp, 0.0, 0, False
    eps = 1e-9  # times are sums of the costs: compare with a tolerance
    while len(done) < 3 * n * m:
        started = False
        for r in range(pp):
            if busy[r] > t + eps:
                continue
            c = _pick(ranks[r], nxt, pending[r], n, m, done, t + eps, placement.per_rank * pp, hold, relax)
            if c is None:
                continue
            op, s, mb = c
            busy[r] = done[c] = t + cost[op]
            orders[r].append(c)
            started = True
            if op == "W":
                pending[r].remove((s, mb))
            else:
                nxt[(op, s)] += 1
                if op == "B":
                    pending[r].append((s, mb))
        later = [e for e in busy if e > t + eps]
        relax = not later and not started and not relax  # every rank stuck: replay t with the limit relaxed
        if not relax:
            t = min(later) if later else t + 1.0
        steps += 1
        if steps > 8 * n * m * pp + 16:  # cannot happen with the rules above; a guard against a wrong change
            raise RuntimeError("zero-bubble list scheduling made no progress")
    return orders


def compute_times(orders: list[list[Compute]], n_stages: int, duration: Callable[[str, int], float] | None = None,
                  transfer: float = 0.0) -> dict[Compute, tuple[float, float]]:
    """(start, end) of every compute when each rank runs its order as soon as the inputs exist; `duration(op,
    stage)` gives each compute's time (default unit time: F, B and W one unit each, an unsplit B two); an input
    made on another rank arrives `transfer` after its producer ends."""
    split = any(op == "W" for order in orders for op, _, _ in order)
    if duration is None:
        def duration(op: str, _s: int) -> float:
            return 2 if op == "B" and not split else 1
    rank_of = {s: r for r, order in enumerate(orders) for _, s, _ in order}
    times: dict[Compute, tuple[float, float]] = {}
    pcs, free = [0] * len(orders), [0.0] * len(orders)
    while any(pc < len(o) for pc, o in zip(pcs, orders)):
        moved = False
        for r, order in enumerate(orders):
            while pcs[r] < len(order):
                op, s, mb = order[pcs[r]]
                dep = dependency(op, s, mb, n_stages)
                if dep is not None and dep not in times:
                    break
                start = free[r] if dep is None else \
                    max(free[r], times[dep][1] + (transfer if rank_of[dep[1]] != r else 0.0))
                free[r] = start + duration(op, s)
                times[(op, s, mb)] = (start, free[r])
                pcs[r] += 1
                moved = True
        if not moved:
            raise ScheduleError("the ranks' compute orders wait on each other (a bug in the builder)")
    return times


def _messages(op: str, s: int, mb: int, n_stages: int) -> tuple[Action | None, Action | None]:
    """(the send after compute (op, s, mb), the matching receive on the consumer) or (None, None)."""
    if op == "F" and s < n_stages - 1:
        return Action("SA", mb, s), Action("RA", mb, s + 1)
    if op == "B" and s > 0:
        return Action("SG", mb, s), Action("RG", mb, s - 1)
    return None, None


def with_rank_messages(orders: list[list[Compute]], placement: Placement, rendezvous: bool = True
                       ) -> list[RankProgram]:
    """Every rank's compute order with its messages. A send is posted when its producer finishes. On a rendezvous
    transport (NCCL, gloo) its receive is posted in the same group at the other end, at that moment of the
    unit-time play of `compute_times`: at every such moment each rank posts one group, so every group finds its
    partners posting theirs (ranks meet moment by moment, never waiting on each other in a cycle). `rendezvous`
    False (a ring transport, the copy engine: a receive is a stream wait for a flag) posts each receive alone just
    before its consumer, so a rank waits only where its next compute needs the message; a unit-time moment would
    stall its stream early whenever the passes' real times differ (B longer than W). A message inside a rank is
    taken (RA / RG: a stream wait) just before its consumer."""
    n = placement.n_stages
    times = compute_times(orders, n)
    events: list[list[tuple[tuple[int, int], int, Step]]] = [[] for _ in orders]  # ((time, 0 group | 1 compute),
    groups: list[dict[int, list[Action]]] = [{} for _ in orders]
    for r, order in enumerate(orders):
        for c in order:
            start, end = times[c]
            op, s, mb = c
            send, recv = _messages(op, s, mb, n)
            if send is not None:
                consumer = recv.stage
                groups[r].setdefault(end, []).append(send)
                if rendezvous and placement.remote(s, consumer):
                    groups[placement.rank_of(consumer)].setdefault(end, []).append(recv)
            need = _messages("F", s - 1, mb, n)[1] if op == "F" and s > 0 else \
                _messages("B", s + 1, mb, n)[1] if op == "B" and s < n - 1 else None
            if need is not None and (not rendezvous or not placement.remote(s, s - 1 if op == "F" else s + 1)):
                events[r].append(((start, 1), s, (need,)))
            events[r].append(((start, 2), s, (Action(op, mb, s),)))
    for r, by_time in enumerate(groups):
        for t, actions in by_time.items():
            events[r].append(((t, 0), actions[0].stage, tuple(actions)))
    return [[(s, step) for _, s, step in sorted(ev, key=lambda e: e[0])] for ev in events]


def rank_orders(schedule: str, placement: Placement, m: int, memory: str = "fast") -> list[list[Compute]]:
    """Every pipeline position's compute order for `schedule` (interleaved, zbv or zb-interleaved) on `placement`;
    `memory`: --zb-memory."""
    if schedule == "interleaved" and placement.shape == LOOP:
        return [interleaved_order(r, placement.pp, placement.per_rank, m) for r in range(placement.pp)]
    if (schedule, placement.shape) in (("zbv", V_SHAPE), ("zb-interleaved", LOOP)):
        return zero_bubble_orders(placement, m, memory)
    raise ScheduleError(f"schedule {schedule!r} does not run on a {placement.shape} placement")


def stage_programs(rank_programs: list[RankProgram], n_stages: int) -> list[list[Step]]:
    """Each stage's own steps (its actions of every rank step, without the stage tag): for check_program and the
    per-stage view."""
    programs: list[list[Step]] = [[] for _ in range(n_stages)]
    for program in rank_programs:
        for stage, step in program:
            by_stage: dict[int, list[Action]] = {}
            for a in step:
                by_stage.setdefault(a.stage if a.stage >= 0 else stage, []).append(Action(a.op, a.mb))
            for s, actions in by_stage.items():
                programs[s].append(tuple(actions))
    return programs
