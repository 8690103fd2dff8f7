"""Compute orders found by playing a pipeline in unit time steps (list scheduling), for the zero-bubble schedules.

Every stage runs F (forward), B (input gradient) and, when the backward is split, W (weight gradient) of each
microbatch. A stage is busy one time unit per action (`COSTS` scales them). With `first_stage_whole_w` the first
stage of a split backward costs what it does in the engine: its input (the data) needs no gradient, so its B does
nothing and its W is the whole backward (split_backward.py), B 0 units and W 2 (`action_cost`). F of stage s
waits for F of s-1, B of s for B of s+1 (the last stage's B for its own F), W for its own B. When a rank is free
it takes, in this order:
a W when it already holds `w_limit` deferred ones; a ready B (the critical path); a ready F while fewer than
`f_limit` microbatches sit between their F and B on the stage (1F1B's activation memory) and, with `hold_limit`,
fewer than that many between their F and W (a deferred W holds its Linears' inputs and gradients, about a
forward's activations: the cap is what keeps a zero-bubble stage within 1F1B's memory); any pending W (the bubble
filler). The result is each stage's order of (op, microbatch); schedule.py adds the messages.
"""

from __future__ import annotations

from collections.abc import Callable

COSTS = {"F": 1, "B": 1, "W": 1}


def action_cost(op: str, s: int, split: bool, first_stage_whole_w: bool = False) -> int:
    """Time units of (op, stage s): COSTS, a whole backward (B + W) for an unsplit B, and with
    `first_stage_whole_w` on the first stage of a split backward nothing for B and the whole backward for W."""
    if not split:
        return COSTS["F"] if op == "F" else COSTS["B"] + COSTS["W"]
    if first_stage_whole_w and s == 0 and op in ("B", "W"):
        return 0 if op == "B" else COSTS["B"] + COSTS["W"]
    return COSTS[op]


def dependency(op: str, s: int, mb: int, n_stages: int) -> tuple[str, int, int] | None:
    """The compute whose output (op, s, mb) consumes: the previous stage's F, the next stage's B (the last stage's
    own F), the same B for a W; None for the first stage's F."""
    if op == "F":
        return None if s == 0 else ("F", s - 1, mb)
    if op == "B":
        return ("F", s, mb) if s == n_stages - 1 else ("B", s + 1, mb)
    return ("B", s, mb)


def is_ready(op: str, s: int, mb: int, n_stages: int, done: dict[tuple[str, int, int], int], t: int) -> bool:
    """Whether (op, s, mb)'s dependency finished by time t."""
    dep = dependency(op, s, mb, n_stages)
    return dep is None or done.get(dep, t + 1) <= t


class _Stage:
    """The progress of one stage: next F and B microbatch, deferred Ws, its order so far."""

    def __init__(self) -> None:
        self.next_f = self.next_b = 0
        self.pending_w: list[int] = []
        self.order: list[tuple[str, int]] = []


def _pick(s: int, st: _Stage, m: int, n_stages: int, done: dict, t: int, split: bool,
          f_limit: int, w_limit: int, hold_limit: int | None = None) -> tuple[str, int] | None:
    """The action stage s starts at time t, or None (nothing ready)."""
    if split and st.pending_w and len(st.pending_w) >= w_limit:
        return "W", st.pending_w[0]
    if st.next_b < st.next_f and is_ready("B", s, st.next_b, n_stages, done, t):
        return "B", st.next_b
    in_flight = st.next_f - st.next_b
    held = in_flight + len(st.pending_w)  # microbatches whose W has not run: each holds memory
    if (st.next_f < m and in_flight < f_limit and (hold_limit is None or held < hold_limit)
            and is_ready("F", s, st.next_f, n_stages, done, t)):
        return "F", st.next_f
    if split and st.pending_w:
        return "W", st.pending_w[0]
    return None


def compute_orders(n_stages: int, m: int, *, split: bool, f_limit: Callable[[int], int],
                   w_limit: Callable[[int], int], first_stage_whole_w: bool = False,
                   hold_limit: Callable[[int], int] | None = None) -> list[list[tuple[str, int]]]:
    """Each stage's (op, microbatch) order, one stage per rank, played in unit time steps. `hold_limit(s)` caps
    the microbatches stage s holds, its deferred Ws counted (F waits until one W has run)."""
    stages = [_Stage() for _ in range(n_stages)]
    done: dict[tuple[str, int, int], int] = {}
    busy_until = [0] * n_stages
    total = n_stages * m * (3 if split else 2)
    t = 0
    while len(done) < total:
        for s, st in enumerate(stages):
            while busy_until[s] <= t:  # a zero-cost action leaves the stage free to take another at once
                act = _pick(s, st, m, n_stages, done, t, split, f_limit(s), w_limit(s),
                            None if hold_limit is None else hold_limit(s))
                if act is None:
                    break
                op, mb = act
                busy_until[s] = done[(op, s, mb)] = t + action_cost(op, s, split, first_stage_whole_w)
                st.order.append(act)
                if op == "F":
                    st.next_f += 1
                elif op == "B":
                    st.next_b += 1
                    if split:
                        st.pending_w.append(mb)
                else:
                    st.pending_w.remove(mb)
        t += 1
        if t > 4 * total + 16:  # cannot happen with the rules above; a guard against a wrong change
            raise RuntimeError("list scheduling made no progress")
    return [st.order for st in stages]


def makespan(orders: list[list[tuple[str, int]]], split: bool = True, first_stage_whole_w: bool = False) -> int:
    """Time units the orders take when each stage runs them in order as soon as dependencies allow."""
    n = len(orders)
    done: dict[tuple[str, int, int], int] = {}
    pcs, free = [0] * n, [0] * n
    while any(pc < len(o) for pc, o in zip(pcs, orders)):
        moved = False
        for s, order in enumerate(orders):
            while pcs[s] < len(order):
                op, mb = order[pcs[s]]
                dep = None if op == "F" and s == 0 else (
                    ("F", s - 1, mb) if op == "F" else
                    (("F", s, mb) if s == n - 1 else ("B", s + 1, mb)) if op == "B" else ("B", s, mb))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0)
                free[s] = start + action_cost(op, s, split, first_stage_whole_w)
                done[(op, s, mb)] = free[s]
                pcs[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("orders deadlock")
    return max(free)
