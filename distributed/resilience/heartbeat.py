"""Every rank's progress in the rendezvous store, so a failure names the rank that actually stopped.

A rank's own view of a failure is what it waits for: a peer's activation, the gradient all-reduce of its replicas,
the loss read. With dp > 1 that peer is often only another waiter (a rank in the all-reduce waits for its replica,
which waits for the rank that hung). So each rank's watchdog thread publishes a beat to the c10d store every poll:

    peerline/beat/<rank> = {"seq": n, "it": iteration, "on": [ranks it waits for] or null, "desc": what,
                            "idle": seconds since its last progress, "end": why it is exiting, or null,
                            "peak": peak device memory GiB or null}

and at a timeout, a communication error or a launcher's signal, `diagnose()` reads every rank's beat twice, a few
polls apart, and names who stopped (`name_stopped`, pure):

  1. ranks whose beat did not advance (or never came): their process died or froze;
  2. else ranks in no wait that made no progress: they stopped on their own (a hang in user code, a stuck kernel);
  3. else following "waits for" from this rank to a rank that waits for nobody, or around a cycle.

The first rank that names who stopped also writes that sentence to `peerline/verdict`; every watchdog thread
reads it with its beat and keeps it, so a rank that fails later, after the store's host (rank 0, under mpirun or
plain launches) has exited, still names the right rank. Store operations run on the watchdog's thread with a
bound: a store whose host died must not block the line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "peerline/beat"
VERDICT = "peerline/verdict"  # the first diagnosis of the job: ranks cache it, so it outlives the store's host


@dataclass(frozen=True, slots=True)
class Beat:
    """One rank's last published state."""

    seq: int
    iteration: int
    waiting_on: tuple[int, ...] | None  # None: in no wait (computing, or stopped outside a wait)
    desc: str
    idle_s: float
    end: str | None = None
    peak_gib: float | None = None

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "it": self.iteration, "on": self.waiting_on, "desc": self.desc[:300],
                           "idle": round(self.idle_s, 2), "end": self.end, "peak": self.peak_gib})

    @classmethod
    def from_json(cls, text: str) -> Beat:
        d = json.loads(text)
        on = d.get("on")
        return cls(int(d["seq"]), int(d["it"]), tuple(on) if on is not None else None, str(d.get("desc", "")),
                   float(d.get("idle", 0.0)), d.get("end"), d.get("peak"))


class Heartbeat:
    """Publishes one rank's beats and reads everyone's; `name(r)` says 'rank r (stage s)'."""

    def __init__(self, store: Any, rank: int, world: int, name: Callable[[int], str]) -> None:
        self.store, self.rank, self.world, self.name = store, rank, world, name
        self.seq = 0

    def publish(self, beat: Beat) -> None:
        self.store.set(f"{PREFIX}/{self.rank}", beat.to_json())

    def publish_verdict(self, text: str) -> None:
        if not self.store.check([VERDICT]):
            self.store.set(VERDICT, text)

    def read_verdict(self) -> str | None:
        return self.store.get(VERDICT).decode() if self.store.check([VERDICT]) else None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def read_all(self) -> dict[int, Beat | None]:
        """Every rank's last beat (None: never published)."""
        beats: dict[int, Beat | None] = {}
        for r in range(self.world):
            key = f"{PREFIX}/{r}"
            beats[r] = Beat.from_json(self.store.get(key).decode()) if self.store.check([key]) else None
        return beats

    def diagnose(self, wait_s: float, stall_s: float, tick: Callable[[], None], tick_s: float) -> str | None:
        """Who stopped, read from two rounds of beats `wait_s` apart (raises if the store is unreachable); `tick`
        publishes this rank's beat meanwhile every `tick_s`, so ranks diagnosing at once do not see each other
        as frozen."""
        before = self.read_all()
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            tick()
            time.sleep(min(tick_s, max(0.0, end - time.monotonic())))
        after = self.read_all()
        return name_stopped(before, after, self.rank, stall_s, self.name)

    def peaks(self) -> dict[int, float]:
        """Every rank's last published peak device memory, GiB (ranks that published none are left out)."""
        return {r: b.peak_gib for r, b in self.read_all().items() if b is not None and b.peak_gib is not None}


def name_stopped(before: dict[int, Beat | None], after: dict[int, Beat | None], me: int, stall_s: float,
                 name: Callable[[int], str]) -> str | None:
    """The sentence naming the rank(s) that stopped, or None when the beats show nobody (see the module
    docstring for the order of the rules)."""
    others = [r for r in after if r != me]
    gone = [r for r in others if after[r] is None or (before.get(r) is not None and after[r].end is None
                                                      and after[r].seq == before[r].seq)]
    if gone:
        seen = [f"{name(r)} (last seen in iteration {after[r].iteration}, {_state(after[r])})" if after[r] else
                f"{name(r)} (never published its progress)" for r in gone]
        return f"{_join(seen)} stopped responding: its process died or froze"
    stuck = [r for r, b in after.items() if b is not None and b.end is None and b.waiting_on is None
             and b.idle_s >= stall_s]
    if stuck:
        who = _join([name(r) for r in stuck])
        its = _join(sorted({str(after[r].iteration) for r in stuck}))
        return (f"{who} stopped in iteration {its}: no progress for {max(after[r].idle_s for r in stuck):.0f} s, "
                "waiting for no other rank")
    return _follow(after, me, name)


def _follow(after: dict[int, Beat | None], me: int, name: Callable[[int], str]) -> str | None:
    """Follow 'waits for' from `me`: to a rank in no wait (it stopped), or around a cycle."""
    path, r = [me], me
    while True:
        beat = after.get(r)
        if beat is not None and beat.waiting_on == ():
            return None  # in a wait on ranks it did not name: nothing to follow
        if beat is None or not beat.waiting_on:
            if r == me:
                return None
            return f"{name(r)} stopped in iteration {beat.iteration if beat else '?'}, waiting for no other rank"
        nxt = next((x for x in beat.waiting_on if x not in path), None)
        if nxt is None:
            return f"{_join([name(x) for x in path])} wait for each other"
        path.append(nxt)
        r = nxt


def _state(beat: Beat) -> str:
    return f"waiting for {beat.desc}" if beat.waiting_on else "in no wait"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
