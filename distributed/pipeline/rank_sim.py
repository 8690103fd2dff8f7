"""The deadlock simulator for rank programs (several stages per rank): every rank runs its program in order.

Like schedule.simulate, but a process is a rank, not a stage: a rank waits in its current step, whichever stage
the step belongs to (a host blocked in a gloo or NCCL exchange, a p2p lane blocked on a slot). A message between
two stages of one rank is there once its producer ran (a stream wait, no slot). Between ranks: rendezvous
(capacity None: a send completes only together with its posted receive) or a ring of K slots per channel, where
message id n (placement.message_keys) takes slot n % K and waits until the message before it in that slot was
released: after the receiver's backward of that microbatch, or its W where the backward splits. Each stage's own
steps must also pass schedule.check_program (every microbatch once each way, in order with its messages).
"""

from __future__ import annotations

from peerline.distributed.p2p.base import ACT, GRAD
from peerline.distributed.pipeline.placement import MessageKey, Placement, message_keys
from peerline.distributed.pipeline.rank_schedule import RankProgram, stage_programs
from peerline.distributed.pipeline.schedule import COMPUTE, Action, ScheduleError, check_program, step_str


def _message(a: Action, stage: int) -> tuple[MessageKey, int, bool]:
    """(message key, other stage, whether `a` sends it) of a communication action of `stage`."""
    if a.op == "SA":
        return (ACT, stage, a.mb), stage + 1, True
    if a.op == "RA":
        return (ACT, stage - 1, a.mb), stage - 1, False
    if a.op == "SG":
        return (GRAD, stage - 1, a.mb), stage - 1, True
    return (GRAD, stage, a.mb), stage + 1, False


class _RankSimulation:
    def __init__(self, programs: list[RankProgram], placement: Placement, capacity: int | None) -> None:
        self.programs, self.placement, self.capacity = programs, placement, capacity
        self.keys = message_keys(programs, placement)
        self.pcs = [0] * len(programs)
        self.done: list[set[Action]] = [set() for _ in programs]
        self.local: set[MessageKey] = set()  # handed over inside a rank
        self.sent: set[MessageKey] = set()  # in a slot, not yet received
        self.slots: dict[tuple[int, str, int], MessageKey] = {}  # (receiver rank, channel, slot) -> occupant
        self.held: dict[tuple[int, int], list[tuple[int, str, int]]] = {}  # (stage, mb) -> slots it holds
        splits = {a.stage for p in programs for _, step in p for a in step if a.op == "W"}
        self.release_op = {s: ("W" if s in splits else "B") for s in range(placement.n_stages)}

    def current(self, rank: int) -> tuple[int, tuple] | None:
        return self.programs[rank][self.pcs[rank]] if self.pcs[rank] < len(self.programs[rank]) else None

    def advance(self, rank: int) -> bool:
        entry = self.current(rank)
        if entry is None:
            return False
        stage, step = entry
        if step[0].op in COMPUTE:
            if step[0].op == self.release_op[stage]:
                for slot in self.held.pop((stage, step[0].mb), []):
                    del self.slots[slot]
            self.pcs[rank] += 1
            return True
        moved = False
        for a in step:
            if a not in self.done[rank] and self._post(rank, a, a.stage if a.stage >= 0 else stage):
                moved = True
        if all(a in self.done[rank] for a in step):
            self.done[rank].clear()
            self.pcs[rank] += 1
            moved = True
        return moved

    def _post(self, rank: int, a: Action, stage: int) -> bool:
        key, other, sending = _message(a, stage)
        if not self.placement.remote(stage, other):
            if sending:
                self.local.add(key)
            elif key not in self.local:
                return False
            self.done[rank].add(a)
            return True
        peer = self.placement.rank_of(other)
        channel, ident = self.keys[key]
        if sending and self.capacity is None:
            entry = self.current(peer)
            match = Action("RA" if a.op == "SA" else "RG", a.mb, other)
            if entry is None or match not in self._tagged(entry) or match in self._tagged_done(peer):
                return False
            self.done[rank].add(a)
            self.done[peer].add(self._untag(entry, match))
            self.held.setdefault((other, a.mb), [])
            return True
        if sending:
            slot = (peer, channel, ident % self.capacity)
            if slot in self.slots:
                return False
            self.slots[slot] = key
            self.sent.add(key)
            self.held.setdefault((other, a.mb), []).append(slot)
        elif self.capacity is None or key not in self.sent:
            return False
        else:
            self.sent.discard(key)
        self.done[rank].add(a)
        return True

    @staticmethod
    def _tagged(entry: tuple[int, tuple]) -> set[Action]:
        stage, step = entry
        return {Action(a.op, a.mb, a.stage if a.stage >= 0 else stage) for a in step}

    def _tagged_done(self, rank: int) -> set[Action]:
        stage = self.current(rank)[0]
        return {Action(a.op, a.mb, a.stage if a.stage >= 0 else stage) for a in self.done[rank]}

    @staticmethod
    def _untag(entry: tuple[int, tuple], match: Action) -> Action:
        stage, step = entry
        return next(a for a in step if Action(a.op, a.mb, a.stage if a.stage >= 0 else stage) == match)


def simulate_ranks(programs: list[RankProgram], placement: Placement, m: int, capacity: int | None = None) -> None:
    """Check every stage's own steps, then play the rank programs against each other; raise ScheduleError with
    a table of steps x ranks marking where each rank waits if they deadlock."""
    for s, steps in enumerate(stage_programs(programs, placement.n_stages)):
        check_program(s, placement.n_stages, m, steps)
    sim = _RankSimulation(programs, placement, capacity)
    while not all(pc == len(p) for pc, p in zip(sim.pcs, programs)):
        if not any([sim.advance(r) for r in range(len(programs))]):
            model = "rendezvous" if capacity is None else f"{capacity} slot(s) per channel"
            raise ScheduleError(f"schedule deadlocks ({model}); '>' marks where each rank waits:\n"
                                + rank_table(programs, sim.pcs))


def min_rank_capacity(programs: list[RankProgram], placement: Placement, m: int, limit: int = 256) -> int:
    """Fewest ring slots per channel with which the rank programs run to the end."""
    for k in range(1, limit + 1):
        try:
            simulate_ranks(programs, placement, m, k)
            return k
        except ScheduleError:
            continue
    raise ScheduleError(f"schedule needs more than {limit} slots per channel")


def rank_table(programs: list[RankProgram], pcs: list[int] | None = None) -> str:
    """Steps x ranks; Fn@s is microbatch n's forward on stage s; '>' marks a rank's current step."""
    pcs = pcs if pcs is not None else [-1] * len(programs)
    width = max(len(f"rank {len(programs) - 1}"), *(len(step_str(s)) + 1 for p in programs for _, s in p))
    rows = [" step | " + " | ".join(f"rank {r}".ljust(width) for r in range(len(programs)))]
    for i in range(max(len(p) for p in programs)):
        cells = [(">" if i == pcs[r] else " ") + (step_str(p[i][1]) if i < len(p) else "") for r, p in
                 enumerate(programs)]
        rows.append(f" {i:4d} | " + " | ".join(c.ljust(width) for c in cells))
    return "\n".join(rows)
