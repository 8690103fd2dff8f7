"""The ideal time of a pipelined iteration, from measured per-microbatch forward and backward times per stage.

Two figures, both with free communication:
  bubble_bound_ms  (M + P - 1) x max over stages of (fwd + bwd): the textbook bound for GPipe and 1F1B, exact when
                   the stages are balanced (every stage idles (P - 1) slots of the slowest stage's work).
  simulate_ms      the makespan of the schedule's own per-stage order of F and B (and W where the backward is
                   split, B and W taking half the measured backward each) with the measured per-stage times,
                   every action starting as soon as its dependencies are done: tighter when stages are uneven
                   (it is <= the bound for GPipe and 1F1B), and the zero-bubble schedules' own bubble. For the
                   schedules that place several stages per rank (interleaved, zbv, zb-interleaved) the lists hold
                   every global stage and the resources are the ranks (`per_rank` stages each, placed as the run
                   places them).
  schedule_bubble  the idle share of a balanced pipeline under a schedule (from simulate_ms in unit times).
An achieved iteration also pays the gradient all-reduce that is not overlapped, the optimizer step and the
transfers; `IdealReport` prints the achieved time next to the bound and their ratio (1.0 = at the bound).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from peerline.choices import DEFAULT_ZB_ORDER, SCHEDULES
from peerline.distributed.observe.timeline import Span
from peerline.distributed.observe.timeline_check import compute_kind, default_placement, local_stage


def _check(microbatches: int, fwd_ms: list[float], bwd_ms: list[float]) -> None:
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if not fwd_ms or len(fwd_ms) != len(bwd_ms):
        raise ValueError(f"need one forward and one backward time per stage, got {len(fwd_ms)} and {len(bwd_ms)}")
    if any(t < 0 for t in [*fwd_ms, *bwd_ms]):
        raise ValueError("stage times must be non-negative")


def bubble_bound_ms(microbatches: int, fwd_ms: list[float], bwd_ms: list[float]) -> float:
    """(M + P - 1) x the slowest stage's forward + backward of one microbatch (GPipe and 1F1B alike)."""
    _check(microbatches, fwd_ms, bwd_ms)
    return (microbatches + len(fwd_ms) - 1) * max(f + b for f, b in zip(fwd_ms, bwd_ms, strict=True))


def bubble_fraction(microbatches: int, stages: int) -> float:
    """Share of a balanced pipeline's time that every stage spends idle: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards and backwards: [("F", mb) | ("B", mb)]."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, m)
        order = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i), ("B", i)]
        return order + [("B", i) for i in range(m - warm, m)]
    if schedule in PLACED:
        raise ValueError(f"{schedule} orders ranks, not stages: use rank_orders")
    if schedule in SCHEDULES:  # the zero-bubble schedules: their compute order, B and W split
        from peerline.distributed.pipeline import schedule as sched

        program = sched.build(schedule, stages, m)[stage]
        return [(step[0].op, step[0].mb) for step in program if step[0].op in sched.COMPUTE]
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


PLACED = ("interleaved", "zbv", "zb-interleaved")  # several stages per rank: rank orders (pipeline/rank_schedule.py)
SPLIT = ("zbv", "zb-interleaved")  # the placed schedules whose backward splits into B and W


def stages_per_rank(schedule: str, pp: int = 1, layers: int = 0) -> int:
    """The --stages a bench variant of `schedule` runs with: one for a stage per rank, two for interleaved and zbv;
    for zb-interleaved the most of 4, 3 that split `layers` evenly over pp ranks (its warm-up shrinks with more
    stages per rank), else two."""
    if schedule == "zb-interleaved":
        return next((v for v in (4, 3) if layers >= pp * v and layers % (pp * v) == 0), 2)
    return 2 if schedule in PLACED else 1


def rank_orders(schedule: str, stages: int, microbatches: int, per_rank: int = 2, order: str = DEFAULT_ZB_ORDER
                ) -> list[list[tuple[str, int, int]]]:
    """Each rank's (op, stage, mb) order of a placed schedule over `stages` global stages (`order`: --zb-order)."""
    from peerline.distributed.pipeline.order_search import run_orders
    from peerline.distributed.pipeline.placement import Placement, placement_for

    if stages % per_rank:
        raise ValueError(f"{schedule}: {stages} stages do not fill ranks of {per_rank}")
    placement: Placement = placement_for(schedule, stages // per_rank, per_rank)
    return run_orders(schedule, placement, microbatches, order=order)


def _placed_ms(schedule: str, microbatches: int, fwd_ms: list[float], bwd_ms: list[float], per_rank: int,
               order: str = DEFAULT_ZB_ORDER) -> float:
    """simulate_ms of a placed schedule: ranks run their orders, each action as soon as its input exists."""
    n = len(fwd_ms)
    orders = rank_orders(schedule, n, microbatches, per_rank, order)
    split = schedule in SPLIT

    def duration(op: str, s: int) -> float:
        return fwd_ms[s] if op == "F" else bwd_ms[s] * (0.5 if split else 1.0)

    from peerline.distributed.pipeline.rank_schedule import compute_times
    return max(end for _, end in compute_times(orders, n, duration).values())


def schedule_bubble(schedule: str, microbatches: int, pp: int, per_rank: int = 1, order: str = DEFAULT_ZB_ORDER
                    ) -> float:
    """Idle share of each rank of a balanced pipeline (forward 1, backward 2 per stage's work) under `schedule`:
    1 - work / makespan; 1f1b and gpipe give (pp - 1) / (M + pp - 1)."""
    v = per_rank if schedule in PLACED else 1
    n = pp * v
    ms = simulate_ms(schedule, microbatches, [1.0 / v] * n, [2.0 / v] * n, per_rank=v, order=order)
    return 1.0 - 3.0 * microbatches / ms


def simulate_ms(schedule: str, microbatches: int, fwd_ms: list[float], bwd_ms: list[float],
                per_rank: int = 2, order: str = DEFAULT_ZB_ORDER) -> float:
    """Makespan of the schedule with free communication: each stage runs its order; an action starts when the
    stage is free and its inputs exist (F after the previous stage's F, B after the next stage's B and the
    stage's own F). `per_rank`: stages per rank of the placed schedules (interleaved, zbv,
    zb-interleaved)."""
    _check(microbatches, fwd_ms, bwd_ms)
    if schedule in PLACED:
        return _placed_ms(schedule, microbatches, fwd_ms, bwd_ms, per_rank, order)
    p = len(fwd_ms)
    orders = [stage_order(schedule, s, p, microbatches) for s in range(p)]
    split = any(kind == "W" for order in orders for kind, _ in order)
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, mb = orders[s][pos[s]]
                if kind == "F":
                    deps = [("F", mb, s - 1)] if s > 0 else []
                elif kind == "W":
                    deps = [("B", mb, s)]
                else:
                    deps = [("F", mb, s)] + ([("B", mb, s + 1)] if s < p - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[s], *(done[d] for d in deps)])
                # a split backward: B (input gradient) and W (weight gradients) take half the backward each
                free[s] = start + (fwd_ms[s] if kind == "F" else bwd_ms[s] * (0.5 if split else 1.0))
                done[(kind, mb, s)] = free[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks in simulation (a bug in stage_order)")
    return max(free)


def stage_times_from_spans(spans_by_rank: dict[int, list[Span]], pp: int, stages_per_rank: int = 1,
                           replica: int = 0) -> tuple[list[float], list[float]]:
    """Median forward and backward span duration per global stage of one replica, from a gathered timeline.
    Spans measured inside a pipelined iteration include any wait queued on the compute stream within the span,
    so times measured in isolation are the better input to the bound when available."""
    place = default_placement(pp, stages_per_rank)
    n = pp * stages_per_rank
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    for rank, spans in spans_by_rank.items():
        for sp in spans:
            kind = compute_kind(sp)
            if kind is None:
                continue
            stage, rep = place(rank, local_stage(sp))
            if rep == replica:
                (fwd if kind[0] == "F" else bwd)[stage].append(sp.duration_ms)
    if any(not f for f in fwd) or any(not b for b in bwd):
        raise ValueError("the timeline lacks forward or backward spans of some stage")
    return [statistics.median(f) for f in fwd], [statistics.median(b) for b in bwd]


@dataclass(frozen=True, slots=True)
class IdealReport:
    """Achieved iteration time next to the ideal one."""

    schedule: str
    microbatches: int
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    achieved_ms: float

    @property
    def bound_ms(self) -> float:
        return bubble_bound_ms(self.microbatches, list(self.fwd_ms), list(self.bwd_ms))

    @property
    def simulated_ms(self) -> float:
        return simulate_ms(self.schedule, self.microbatches, list(self.fwd_ms), list(self.bwd_ms))

    @property
    def ratio(self) -> float:
        """bound / achieved: 1.0 means the iteration ran at the bound, 0.5 that it took twice as long."""
        return self.bound_ms / self.achieved_ms if self.achieved_ms > 0 else float("nan")

    def describe(self) -> str:
        stages = ", ".join(f"{f:.3f}+{b:.3f}" for f, b in zip(self.fwd_ms, self.bwd_ms, strict=True))
        return (f"{self.schedule} M={self.microbatches} P={len(self.fwd_ms)}: achieved {self.achieved_ms:.3f} ms, "
                f"bound (M+P-1) x max(fwd+bwd) {self.bound_ms:.3f} ms (ratio {self.ratio:.3f}), "
                f"simulated {self.simulated_ms:.3f} ms; stage fwd+bwd ms: {stages}")

    def as_dict(self) -> dict[str, object]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "fwd_ms": list(self.fwd_ms),
                "bwd_ms": list(self.bwd_ms), "achieved_ms": self.achieved_ms, "bound_ms": self.bound_ms,
                "simulated_ms": self.simulated_ms, "ratio": self.ratio}
