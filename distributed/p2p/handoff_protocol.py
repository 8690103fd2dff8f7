"""The slot-ring handoff protocol as data, plus a pure-Python model of a sender/receiver pair that runs it.

One pipeline edge and direction owns a ring of `depth` receive slots in the receiver's memory. Per slot there are
two 32-bit flag words:

  FULL  in the receiver's memory; the sender writes 1 after its copy landed, the receiver clears it to 0
  FREE  in the sender's memory; the receiver writes 1 once it no longer reads the slot, the sender clears it to 0

Initial values: FULL = 0, FREE = 1. Every operation writes a constant (0 or 1), never a counter, so a captured
CUDA graph that replays the same sequence stays valid on every replay.

The operations below are what the GPU transport (copy_engine.py) issues, one to one and in this order: `wait`
is CU_STREAM_MEM_OP_WAIT_VALUE_32 (EQ), `write` is CU_STREAM_MEM_OP_WRITE_VALUE_32 (fenced), consecutive ones sent
as one cuStreamBatchMemOp; `copy` is the copy-engine transfer (with split lanes: two halves on two streams that
both start after the preceding flag operations and both end before the following ones). "local" and "peer"
name whose memory a flag lives in, seen from the rank that issues the operation. Keeping the sequence here lets
the CPU tests check exactly what the GPU runs (`PairModel`), with random interleavings and a slow receiver.

Slot of a message: `mb % depth`. Messages of one kind whose microbatches share a slot must be received and
released in the order they were sent; a schedule that holds more than `depth` received messages at once (or
releases out of order into a busy slot) blocks: the model reports it as a deadlock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FULL, FREE = "full", "free"
LOCAL, PEER = "local", "peer"
INITIAL = {FULL: 0, FREE: 1}


@dataclass(frozen=True, slots=True)
class Op:
    """One stream operation. action: 'wait' (until flag == value), 'write' (flag = value) or 'copy' (the
    message into `slot` of the receiver's ring)."""

    action: str
    slot: int
    flag: str = ""
    where: str = ""
    value: int = 0


def slot_of(mb: int, depth: int) -> int:
    """Ring slot that carries microbatch `mb`: static, so a captured graph always uses the same addresses."""
    return mb % depth


def send_ops(slot: int) -> tuple[Op, ...]:
    """Sender, on its p2p stream: wait until the slot is free, take it, copy, announce it full."""
    return (Op("wait", slot, FREE, LOCAL, 1), Op("write", slot, FREE, LOCAL, 0), Op("copy", slot),
            Op("write", slot, FULL, PEER, 1))


def recv_ops(slot: int) -> tuple[Op, ...]:
    """Receiver, on its compute stream: wait until the copy landed, then clear FULL for the slot's next use."""
    return (Op("wait", slot, FULL, LOCAL, 1), Op("write", slot, FULL, LOCAL, 0))


def release_ops(slot: int) -> tuple[Op, ...]:
    """Receiver, on its compute stream once it no longer reads the slot: hand it back to the sender."""
    return (Op("write", slot, FREE, PEER, 1),)


@dataclass(frozen=True, slots=True)
class Protocol:
    """The three op sequences; the tests swap in broken ones to prove the model catches them."""

    send: Callable[[int], tuple[Op, ...]] = send_ops
    recv: Callable[[int], tuple[Op, ...]] = recv_ops
    release: Callable[[int], tuple[Op, ...]] = release_ops


@dataclass
class Outcome:
    """What a model run saw: messages delivered intact (in receive order), protocol violations, deadlock."""

    delivered: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    deadlock: bool = False
    steps: int = 0
    final_flags: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.deadlock


class PairModel:
    """A sender and a receiver running the protocol over one ring, interleaved at random.

    Copies and reads are split into `chunks` steps, so a read that overlaps a copy sees a torn message. The
    receiver plan is a list of ("recv", mb) and ("release", mb) events; between a receive and its release the
    consumer reads the slot (right after the receive and again right before the release), which catches both a
    read before the copy finished and an overwrite of a slot still in use. `receiver_weight` < 1 makes the
    receiver slow: it is picked less often, and `spin` extra idle steps precede each release.
    """

    def __init__(self, depth: int, sends: Sequence[int], receiver_plan: Sequence[tuple[str, int]], *,
                 protocol: Protocol = Protocol(), chunks: int = 3, receiver_weight: float = 1.0, spin: int = 0,
                 seed: int = 0) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth, self.chunks = depth, chunks
        self.rng = random.Random(seed)
        self.weights = {"sender": 1.0, "receiver": receiver_weight}
        self.flags = {FULL: [INITIAL[FULL]] * depth, FREE: [INITIAL[FREE]] * depth}  # FULL: receiver, FREE: sender
        self.slots: list[list[tuple[int, int] | None]] = [[None] * chunks for _ in range(depth)]
        self.held: dict[int, int] = {}  # slot -> mb the consumer may still read
        self.fresh: set[int] = set()  # slots received but not yet read through once
        self.outcome = Outcome()
        self.queues = {"sender": self._sender_steps(sends, protocol),
                       "receiver": self._receiver_steps(receiver_plan, protocol, spin)}

    # --- programs -------------------------------------------------------------------------------------------
    def _sender_steps(self, sends: Sequence[int], protocol: Protocol) -> list[tuple]:
        steps: list[tuple] = []
        for mb in sends:
            for op in protocol.send(slot_of(mb, self.depth)):
                if op.action == "copy":
                    steps += [("copy", op.slot, mb, c) for c in range(self.chunks)]
                else:
                    steps.append(("op", op))
        return steps

    def _receiver_steps(self, plan: Sequence[tuple[str, int]], protocol: Protocol, spin: int) -> list[tuple]:
        steps: list[tuple] = []
        for event, mb in plan:
            slot = slot_of(mb, self.depth)
            if event == "recv":
                steps += [("op", op) for op in protocol.recv(slot)]
                steps.append(("hold", slot, mb))
                steps += [("read", slot, mb, c) for c in range(self.chunks)]
            elif event == "release":
                steps += [("spin",)] * spin
                steps += [("read", slot, mb, c) for c in range(self.chunks)]
                steps.append(("unhold", slot, mb))
                steps += [("op", op) for op in protocol.release(slot)]
            else:
                raise ValueError(f"unknown receiver event {event!r}")
        return steps

    # --- execution ------------------------------------------------------------------------------------------
    def _blocked(self, step: tuple) -> bool:
        if step[0] != "op" or step[1].action != "wait":
            return False
        op: Op = step[1]
        return self.flags[op.flag][op.slot] != op.value

    def _execute(self, who: str, step: tuple) -> None:
        kind = step[0]
        if kind == "op":
            op: Op = step[1]
            if op.action == "write":
                self._check_flag_owner(who, op)
                self.flags[op.flag][op.slot] = op.value
        elif kind == "copy":
            _, slot, mb, chunk = step
            if slot in self.held:
                self.outcome.violations.append(f"copy of mb {mb} overwrote slot {slot} held for mb {self.held[slot]}")
            self.slots[slot][chunk] = (mb, chunk)
        elif kind == "hold":
            self.held[step[1]] = step[2]
            self.fresh.add(step[1])
        elif kind == "read":
            _, slot, mb, chunk = step
            if self.slots[slot][chunk] != (mb, chunk):
                self.outcome.violations.append(
                    f"read of mb {mb} chunk {chunk} in slot {slot} saw {self.slots[slot][chunk]}")
            elif chunk == self.chunks - 1 and slot in self.fresh:
                self.fresh.discard(slot)
                self.outcome.delivered.append(mb)
        elif kind == "unhold":
            self.held.pop(step[1], None)

    def _check_flag_owner(self, who: str, op: Op) -> None:
        """FULL lives with the receiver and FREE with the sender: a 'local' write must be to one's own word."""
        owner = "receiver" if op.flag == FULL else "sender"
        if (op.where == LOCAL) != (owner == who):
            self.outcome.violations.append(f"{who} wrote {op.flag} of slot {op.slot} as {op.where}, owner {owner}")

    def run(self, max_steps: int = 1_000_000) -> Outcome:
        """Interleave both programs at random until both finish or neither can move (deadlock)."""
        pos = {who: 0 for who in self.queues}
        while self.outcome.steps < max_steps:
            live = [w for w in self.queues if pos[w] < len(self.queues[w])]
            if not live:
                break
            ready = [w for w in live if not self._blocked(self.queues[w][pos[w]])]
            if not ready:
                self.outcome.deadlock = True
                break
            who = self.rng.choices(ready, weights=[self.weights[w] for w in ready])[0]
            self._execute(who, self.queues[who][pos[who]])
            pos[who] += 1
            self.outcome.steps += 1
        self.outcome.final_flags = {k: list(v) for k, v in self.flags.items()}
        return self.outcome


def fifo_plan(mbs: Sequence[int], hold: int) -> list[tuple[str, int]]:
    """Receiver plan that keeps up to `hold` received messages before releasing the oldest (1F1B-like when
    hold is small, GPipe when hold = len(mbs))."""
    plan: list[tuple[str, int]] = []
    held: list[int] = []
    for mb in mbs:
        plan.append(("recv", mb))
        held.append(mb)
        if len(held) >= hold:
            plan.append(("release", held.pop(0)))
    plan += [("release", mb) for mb in held]
    return plan
