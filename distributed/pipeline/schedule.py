"""Pipeline schedules as data, and a validator that runs them against each other without running a model.

A schedule gives each stage a program: an ordered list of steps. A step is one compute action (F = forward,
B = backward of a microbatch; with a split backward B = input gradient and W = weight gradient) or a group
of communication actions posted together (SA/RA = send/receive an activation to/from the next/previous stage,
SG/RG = send/receive a gradient to/from the previous/next stage).
Written like "F3" or "SA3+RG1". Posting a send and a receive to the same neighbour as one group is what keeps
two neighbours that send to each other in the same step from deadlocking on a rendezvous transport (NCCL).

`simulate` plays all programs against each other with a transport model: rendezvous (a send completes only
together with its receive) or a ring of K slots per edge and direction (a send waits for a free slot; the
receiver frees it after the backward that used the message, or after its W where the backward is split: W still
reads the received tensors). It returns one valid global order of steps (the
single-device engine issues work in that order) or raises `ScheduleError` with a table of steps x stages that
marks where each stage is stuck.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerline.distributed.config import ConfigError
from peerline.distributed.pipeline import timed

COMPUTE = ("F", "B", "W")
COMM = ("SA", "RA", "SG", "RG")


class ScheduleError(ConfigError):
    """The schedule is invalid or deadlocks; the message holds the table of steps x stages."""


@dataclass(frozen=True, slots=True, order=True)
class Action:
    op: str  # F, B, W, SA, RA, SG, RG
    mb: int
    stage: int = -1  # the global stage it belongs to, in a rank's program of several stages (-1: the step's)

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" if self.stage < 0 else f"{self.op}{self.mb}@{self.stage}"


Step = tuple[Action, ...]  # one compute action, or a group of communication actions posted together


def step_str(step: Step) -> str:
    return "+".join(map(str, step))


def parse_program(text: str) -> list[Step]:
    """'F0 SA0+RG1 B0' -> steps; for tests and for users writing their own schedules."""
    steps = []
    for token in text.split():
        actions = []
        for part in token.split("+"):
            op = part.rstrip("0123456789")
            if op not in COMPUTE + COMM or op == part:
                raise ScheduleError(f"cannot parse action {part!r} in {text!r}")
            actions.append(Action(op, int(part[len(op):])))
        steps.append(tuple(actions))
    return steps


def _comm(*actions: Action | None) -> list[Step]:
    group = tuple(a for a in actions if a is not None)
    return [group] if group else []


def gpipe(stage: int, n_stages: int, m: int) -> list[Step]:
    """All forwards, then all backwards (in the same microbatch order)."""
    first, last = stage == 0, stage == n_stages - 1
    steps: list[Step] = []
    for mb in range(m):
        steps += _comm(None if first else Action("RA", mb))
        steps.append((Action("F", mb),))
        steps += _comm(None if last else Action("SA", mb))
    for mb in range(m):
        steps += _comm(None if last else Action("RG", mb))
        steps.append((Action("B", mb),))
        steps += _comm(None if first else Action("SG", mb))
    return steps


def one_f_one_b(stage: int, n_stages: int, m: int) -> list[Step]:
    """Warm-up forwards (n_stages - stage - 1 of them), then one forward / one backward, then the remaining
    backwards. At most n_stages - stage microbatches are alive on a stage, against m for GPipe."""
    first, last = stage == 0, stage == n_stages - 1
    warmup = min(n_stages - stage - 1, m)
    steps: list[Step] = []
    for mb in range(warmup):
        steps += _comm(None if first else Action("RA", mb))
        steps.append((Action("F", mb),))
        steps += _comm(None if last else Action("SA", mb))
    if warmup < m:
        steps += _comm(None if first else Action("RA", warmup))
    for j in range(m - warmup):
        f = warmup + j
        steps.append((Action("F", f),))
        steps += _comm(None if last else Action("SA", f), None if last else Action("RG", j))
        steps.append((Action("B", j),))
        nxt = f + 1 if not first and f + 1 < m else None
        steps += _comm(None if first else Action("SG", j), None if nxt is None else Action("RA", nxt))
    for j in range(m - warmup, m):
        steps += _comm(None if last else Action("RG", j))
        steps.append((Action("B", j),))
        steps += _comm(None if first else Action("SG", j))
    return steps


def with_messages(stage: int, n_stages: int, order: list[tuple[str, int]]) -> list[Step]:
    """A stage's compute order with its messages: between two computes one group of the sends of the first
    (SA after F, SG after B) and the receives of the second (RA before F, RG before B), posted together."""
    first, last = stage == 0, stage == n_stages - 1

    def sends(op: str, mb: int) -> list[Action]:
        if op == "F" and not last:
            return [Action("SA", mb)]
        return [Action("SG", mb)] if op == "B" and not first else []

    def recvs(op: str, mb: int) -> list[Action]:
        if op == "F" and not first:
            return [Action("RA", mb)]
        return [Action("RG", mb)] if op == "B" and not last else []

    steps: list[Step] = []
    before: list[Action] = []
    for op, mb in order:
        steps += _comm(*before, *recvs(op, mb))
        steps.append((Action(op, mb),))
        before = sends(op, mb)
    return steps + _comm(*before)


def zb_h1(stage: int, n_stages: int, m: int, rendezvous: bool = True, memory: str = "fast") -> list[Step]:
    """Zero bubble H1: 1F1B's forwards and input-gradient passes B, the weight-gradient passes W deferred into the
    waits (timed.py: at most n_stages deferred per stage, 1F1B's activations in flight).

    `rendezvous` False (a ring transport: the copy engine) orders the first stage by what its passes cost in
    split_backward's graph form: its B does nothing and its W is the whole backward, so W(j) runs while gradient
    j + 1 is on its way instead of after it (assemble.whole_w_first_stage says where that form is expected). On a
    rendezvous transport (NCCL, gloo) that order deadlocks: the first stage's lone activation send would wait for
    the next stage, whose lone gradient send waits for the first stage's receive. There every send is
    posted with the next receive, in the order of unit costs.

    `memory` "1f1b" caps what stage s holds, its deferred Ws counted, at 1F1B's n_stages - s microbatches."""
    return with_messages(stage, n_stages, _zb_h1_orders(n_stages, m, rendezvous, memory)[stage])


def _zb_h1_orders(n_stages: int, m: int, rendezvous: bool = True, memory: str = "fast"
                  ) -> list[list[tuple[str, int]]]:
    hold = (lambda s: n_stages - s) if memory == "1f1b" else None
    return timed.compute_orders(n_stages, m, split=True, f_limit=lambda s: n_stages - s,
                                w_limit=lambda s: n_stages, first_stage_whole_w=not rendezvous, hold_limit=hold)


SCHEDULE_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}


def build(schedule: str, n_stages: int, m: int, rendezvous: bool = True, memory: str = "fast"
          ) -> list[list[Step]]:
    """Programs of every stage; `rendezvous` False: for a ring transport only (zb_h1); `memory`: --zb-memory."""
    if schedule not in SCHEDULE_BUILDERS:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_BUILDERS)}")
    if schedule == "1f1b" and m < n_stages:
        raise ScheduleError(f"1f1b needs at least as many microbatches as stages: M={m} < {n_stages} stages "
                            f"(use --microbatches {n_stages} or more, or --schedule gpipe)")
    if schedule == "zb-h1":
        return [with_messages(s, n_stages, order)
                for s, order in enumerate(_zb_h1_orders(n_stages, m, rendezvous, memory))]
    return [SCHEDULE_BUILDERS[schedule](s, n_stages, m) for s in range(n_stages)]


def splits_backward(programs: list[list[Step]]) -> bool:
    """Whether the programs run W steps (the backward split into B and W)."""
    return any(step[0].op == "W" for p in programs for step in p)


def check_program(stage: int, n_stages: int, m: int, steps: list[Step]) -> None:
    """Local rules of one stage's program: every microbatch once forward, once backward (and once W, after its
    B, in a program that splits the backward), in order with its messages."""
    first, last = stage == 0, stage == n_stages - 1
    split = any(step[0].op == "W" for step in steps)
    seen: dict[Action, int] = {}
    for i, step in enumerate(steps):
        ops = {a.op for a in step}
        if len(step) > 1 and ops & set(COMPUTE):
            raise ScheduleError(f"stage {stage} step {i} ({step_str(step)}): a compute action must be alone")
        for a in step:
            if not 0 <= a.mb < m:
                raise ScheduleError(f"stage {stage} step {i}: microbatch {a.mb} outside 0..{m - 1}")
            if a in seen:
                raise ScheduleError(f"stage {stage}: {a} appears twice (steps {seen[a]} and {i})")
            if (first and a.op in ("RA", "SG")) or (last and a.op in ("SA", "RG")):
                raise ScheduleError(f"stage {stage} step {i}: {a} has no neighbour on that side")
            seen[a] = i
    for mb in range(m):
        def at(op: str, mb: int = mb) -> int | None:
            return seen.get(Action(op, mb))

        need = ["F", "B"] + (["W"] if split else []) + ([] if first else ["RA", "SG"]) + \
            ([] if last else ["SA", "RG"])
        for op in need:
            if at(op) is None:
                raise ScheduleError(f"stage {stage}: microbatch {mb} has no {op}")
        order = [("F", "B")] + ([("B", "W")] if split else []) + ([] if first else [("RA", "F"), ("B", "SG")]) + \
            ([] if last else [("F", "SA"), ("RG", "B")])
        for a, b in order:
            if at(a) >= at(b):
                raise ScheduleError(f"stage {stage}: {a}{mb} (step {at(a)}) must come before {b}{mb} "
                                    f"(step {at(b)})")


def _table(programs: list[list[Step]], pcs: list[int]) -> str:
    width = max(len(f"stage {len(programs) - 1}"), *(len(step_str(s)) + 1 for p in programs for s in p))
    rows = [" step | " + " | ".join(f"stage {s}".ljust(width) for s in range(len(programs)))]
    for i in range(max(len(p) for p in programs)):
        cells = []
        for s, p in enumerate(programs):
            text = step_str(p[i]) if i < len(p) else ""
            mark = ">" if i == pcs[s] else " "
            cells.append((mark + text).ljust(width))
        rows.append(f" {i:4d} | " + " | ".join(cells))
    return "\n".join(rows)


def _peer(stage: int, a: Action) -> tuple[int, str]:
    """(other stage, message kind) of a communication action."""
    if a.op in ("SA", "RA"):
        return (stage + 1 if a.op == "SA" else stage - 1), "act"
    return (stage - 1 if a.op == "SG" else stage + 1), "grad"


class _Simulation:
    """The state of one `simulate` run: each stage's position in its program and the messages on the edges."""

    def __init__(self, programs: list[list[Step]], capacity: int | None) -> None:
        n = len(programs)
        self.programs, self.capacity = programs, capacity
        self.pcs = [0] * n
        self.done_ops: list[set[Action]] = [set() for _ in range(n)]  # completed actions of the current group
        self.sent: set[tuple[int, str, int]] = set()  # (receiver stage, kind, mb) sent and not yet received
        self.alive: dict[tuple[int, str], int] = {}  # (receiver stage, kind) -> messages occupying a slot
        self.holding: list[set[tuple[str, int]]] = [set() for _ in range(n)]  # received, not released
        self.order: list[tuple[int, Step]] = []
        # the step after which a stage no longer reads what it received for a microbatch: W where it splits
        self.release_op = ["W" if any(step[0].op == "W" for step in p) else "B" for p in programs]

    def current(self, stage: int) -> Step | None:
        return self.programs[stage][self.pcs[stage]] if self.pcs[stage] < len(self.programs[stage]) else None

    def finished(self) -> bool:
        return all(pc == len(p) for pc, p in zip(self.pcs, self.programs))

    def advance(self, s: int) -> bool:
        """Let stage `s` make what progress it can on its current step; whether anything moved."""
        step = self.current(s)
        if step is None:
            return False
        if step[0].op in COMPUTE:
            if step[0].op == self.release_op[s]:  # what this stage received for mb is consumed: free its slots
                self._release(s, step[0].mb)
            self._complete(s, step)
            return True
        progressed = False
        for a in step:
            if a not in self.done_ops[s] and self._post(s, a):
                progressed = True
        if all(a in self.done_ops[s] for a in step):
            self.done_ops[s].clear()
            self._complete(s, step)
            progressed = True
        return progressed

    def _complete(self, s: int, step: Step) -> None:
        self.order.append((s, step))
        self.pcs[s] += 1

    def _release(self, s: int, mb: int) -> None:
        for kind in ("act", "grad"):
            if (kind, mb) in self.holding[s]:
                self.holding[s].discard((kind, mb))
                self.alive[(s, kind)] -= 1

    def _deliver(self, receiver: int, kind: str, mb: int) -> None:
        self.holding[receiver].add((kind, mb))

    def _post(self, s: int, a: Action) -> bool:
        """Try to complete one communication action of stage `s`; whether it completed."""
        other, kind = _peer(s, a)
        if a.op in ("SA", "SG"):
            if self.capacity is None:  # rendezvous: the partner must be posting the matching receive now
                partner = self.current(other)
                match = Action("RA" if kind == "act" else "RG", a.mb)
                if partner is None or match not in partner or match in self.done_ops[other]:
                    return False
                self.done_ops[s].add(a)
                self.done_ops[other].add(match)
                self._deliver(other, kind, a.mb)
                self.alive[(other, kind)] = self.alive.get((other, kind), 0) + 1
                return True
            if self.alive.get((other, kind), 0) >= self.capacity:
                return False
            self.alive[(other, kind)] = self.alive.get((other, kind), 0) + 1
            self.sent.add((other, kind, a.mb))
            self.done_ops[s].add(a)
            return True
        if self.capacity is not None and (s, kind, a.mb) in self.sent:
            self.sent.discard((s, kind, a.mb))
            self._deliver(s, kind, a.mb)
            self.done_ops[s].add(a)
            return True
        return False


def simulate(programs: list[list[Step]], capacity: int | None = None) -> list[tuple[int, Step]]:
    """Play the programs against each other; return a global order of (stage, step).

    capacity None: rendezvous (a send completes only with its matching receive, both posted). capacity K: a send
    completes when fewer than K messages of its kind are alive on its edge; a message stays alive from its send
    until the receiver's backward of that microbatch, or its W where the backward is split (the consumer releases
    its slot then).
    """
    n = len(programs)
    m = 1 + max((a.mb for p in programs for s in p for a in s), default=0)
    for s, p in enumerate(programs):
        check_program(s, n, m, p)
    sim = _Simulation(programs, capacity)
    while True:
        progressed = False
        for s in range(n):
            if sim.advance(s):
                progressed = True
        if sim.finished():
            return sim.order
        if not progressed:
            model = "rendezvous" if capacity is None else f"{capacity} slot(s) per edge"
            raise ScheduleError(f"schedule deadlocks ({model}); '>' marks where each stage waits:\n"
                                + _table(programs, sim.pcs))


def min_capacity(programs: list[list[Step]], limit: int = 64) -> int:
    """Fewest ring slots per edge and direction with which the programs run to the end."""
    for k in range(1, limit + 1):
        try:
            simulate(programs, k)
            return k
        except ScheduleError:
            continue
    raise ScheduleError(f"schedule needs more than {limit} slots per edge")


LEGEND = ("legend: Fn / Bn forward / backward of microbatch n (Bn: input gradient where Wn follows);\n"
          "        Wn weight gradient of microbatch n; a+b posted together;\n"
          "        SAn / RAn send its activation to the next / receive it from the previous stage;\n"
          "        SGn / RGn send its gradient to the previous / receive it from the next stage")


def render(programs: list[list[Step]]) -> str:
    """The programs as a table of steps x stages with the legend of the action labels (for --print-schedule)."""
    return _table(programs, [-1] * len(programs)) + "\n" + LEGEND
