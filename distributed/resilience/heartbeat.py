"""Every rank's progress in the rendezvous store, so a failure names the rank (and node) that actually stopped.

A rank's own view of a failure is what it waits for: a peer's activation, the gradient all-reduce of its replicas,
the loss read. With dp > 1 that peer is often only another waiter (a rank in the all-reduce waits for its replica,
which waits for the rank that hung). So each rank's beat thread (`Heartbeat.start`), every watchdog poll and soon
after each new iteration (`nudge`: a rank that dies is last seen in the iteration it was in), publishes this rank's
beat to the c10d store

    peerline/beat/<rank> = {"seq": n, "it": iteration, "on": [ranks it waits for] or null, "desc": what,
                            "idle": seconds since its last progress, "end": why it is exiting, or null,
                            "peak": peak device memory GiB or null, "pid": its process id, "node": its host name}

and reads every rank's back into a local table, kept with the local time of each read. Only that thread touches
the store: its calls have no bound (a TCPStore client blocks for as long as a frozen or cut-off host keeps the
connection open), so nothing that must end waits for it longer than it chooses. It talks to the store over its own
connection (`own_connection`): a TCPStore client runs one call at a time for every thread that shares it, so a
main thread blocked in a store barrier (the preemption check waiting for a rank that died) would stop this rank's
beats too, and the others would name this rank, and the store, instead of the rank that died. At a failure,
`explain()` answers from the cached table, without the store (`name_stopped`, pure, compares the newest table with
one a window older):

  1. ranks whose beat did not advance (or never came): their process died or froze, or their node was lost
     (all the ranks of one host: the host is named); a process on this rank's node that is stopped (SIGSTOP, a
     debugger) is named as such, with what the job now waits for: its launcher ends the job only once that
     process is gone, and a stopped process ignores SIGTERM (torchrun waits 30 s, then sends SIGKILL);
  2. else ranks in no wait that made no progress (ended since, or not): they stopped on their own (a hang in user
     code, a stuck kernel); of those, the ones in the earliest iteration (graphs let the others' hosts run ahead);
  3. else following "waits for" from this rank to a rank that waits for nobody, or around a cycle.

When the table is stale (the store has not answered for a few polls: its host stopped or exited, or this rank's
node lost its network), the answer says so, names the store's host (a host rank whose last beat was its exit ended
the store with it), and says when and where each rank was last seen (`name_unreachable`), after the node or ranks
the older tables already show gone. The first rank that names who stopped also writes that sentence to
`peerline/verdict`; every beat thread reads it and keeps it, so a rank that fails later, after the store's host has
exited, still names the right rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "peerline/beat"
VERDICT = "peerline/verdict"  # the first diagnosis of the job: ranks cache it, so it outlives the store's host
Table = dict[int, "Beat | None"]  # every rank's last beat (None: never published)
#: A nudged beat (a new iteration) goes out at most this fraction of the period after the previous one: a few
#: small writes a second per rank, while only the periodic rounds read every rank's beat.
NUDGE_GAP = 0.05
NODE = socket.gethostname()  # this process's host, as the beats name it


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
    pid: int | None = None  # its process, on `node` (the heartbeat fills both in)
    node: str | None = None

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "it": self.iteration, "on": self.waiting_on, "desc": self.desc[:300],
                           "idle": round(self.idle_s, 2), "end": self.end, "peak": self.peak_gib, "pid": self.pid,
                           "node": self.node})

    @classmethod
    def from_json(cls, text: str) -> Beat:
        d = json.loads(text)
        on = d.get("on")
        return cls(int(d["seq"]), int(d["it"]), tuple(on) if on is not None else None, str(d.get("desc", "")),
                   float(d.get("idle", 0.0)), d.get("end"), d.get("peak"), d.get("pid"), d.get("node"))


def own_connection(store: Any) -> Any:
    """A new client connection to `store` for the beat thread alone (`Store.clone`), or `store` itself where the
    store cannot be cloned (an in-process store, whose calls do not block each other)."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError) as exc:
        log.debug("heartbeat: the store cannot be cloned (%s); beats share the process group's connection", exc)
        return store


class Heartbeat:
    """Publishes one rank's beats and caches everyone's; `name(r)` says 'rank r (stage s)', `host(r)` the node of
    rank r when the job spans several (else None), `store_at` where the store is and who hosts it, `store_rank` the
    rank whose process hosts it (None: torchrun's agent)."""

    def __init__(self, store: Any, rank: int, world: int, name: Callable[[int], str],
                 host: Callable[[int], str | None] = lambda _r: None, store_at: str = "",
                 clock: Callable[[], float] = time.monotonic, store_rank: int | None = None) -> None:
        self.store, self.rank, self.world, self.name, self.host = store, rank, world, name, host
        self.store_at, self.clock = store_at, clock
        self.store_rank = store_rank  # the rank whose process hosts the store (None: torchrun's agent)
        self.seq = 0
        self.verdict: str | None = None  # the job's first diagnosis, read from the store and kept
        self.ok_at: float | None = None  # local time of the last complete read of every rank's beat
        self.history: deque[tuple[float, Table]] = deque()  # (local time, table), oldest first
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat's seq, local time that seq first came)
        self.keep_s = 60.0  # how far back the history goes
        self._pending_verdict: str | None = None
        self._rounds = 0
        self._busy = False  # a round is under way (its beat was made before the latest wake-up)
        self._round_wanted = False  # beat_now asked for a full round
        self._nudged = False  # this rank's state changed since its last beat
        self._done = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the store (only the beat thread calls these in a run; tests call them directly) ------------------------
    def publish(self, beat: Beat) -> None:
        if beat.pid is None:
            beat = dataclasses.replace(beat, pid=os.getpid(), node=NODE)
        self.store.set(f"{PREFIX}/{self.rank}", beat.to_json())

    def publish_verdict(self, text: str) -> None:
        if not self.store.check([VERDICT]):
            self.store.set(VERDICT, text)

    def read_verdict(self) -> str | None:
        return self.store.get(VERDICT).decode() if self.store.check([VERDICT]) else None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def read_all(self) -> Table:
        """Every rank's last beat (None: never published)."""
        keys = [f"{PREFIX}/{r}" for r in range(self.world)]
        if self.store.check(keys):  # the usual case: one round trip for all of them
            try:
                return {r: Beat.from_json(v.decode()) for r, v in enumerate(self.store.multi_get(keys))}
            except (AttributeError, NotImplementedError):
                pass
        return {r: Beat.from_json(self.store.get(k).decode()) if self.store.check([k]) else None
                for r, k in enumerate(keys)}

    # -- the beat thread ---------------------------------------------------------------------------------------
    def start(self, make_beat: Callable[[], Beat], period_s: float) -> None:
        """Publish `make_beat()` and read every rank's beat every `period_s`, on a daemon thread; between rounds,
        publish (without reading) after each `nudge()`, at most every `period_s * NUDGE_GAP`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(make_beat, period_s),
                                            name=f"peerline-beat-r{self.rank}", daemon=True)
            self._thread.start()

    def _loop(self, make_beat: Callable[[], Beat], period_s: float) -> None:
        gap = period_s * NUDGE_GAP
        due, published = self.clock(), float("-inf")  # the next full round; the last beat published
        while not self._stop.is_set():
            self._wake.clear()  # before the flags are read: a wake-up after this is never lost
            if self._round_wanted or self.clock() >= due:
                self._round_wanted = self._nudged = False  # before the beat is made: a later nudge stays
                self.round(make_beat())
                published = self.clock()
                due = published + period_s
            elif self._nudged and self.clock() >= published + gap:
                self._nudged = False
                self._publish_quietly(make_beat())
                published = self.clock()
            until = min(due, published + gap) if self._nudged else due
            self._wake.wait(max(0.0, until - self.clock()))

    def nudge(self) -> None:
        """This rank's state changed (a new iteration): publish it soon, so a rank that dies between rounds is
        last seen where it was, not a period earlier. Called every iteration: the thread is woken once per nudged
        beat, not once per call."""
        if not self._nudged:
            self._nudged = True
            self._wake.set()

    def _publish_quietly(self, beat: Beat) -> None:
        try:
            self.publish(beat)
        except Exception as exc:  # noqa: BLE001 - the next full round says what the store does
            log.debug("heartbeat publish failed: %s", exc)

    def round(self, beat: Beat) -> None:
        """One beat: publish this rank's (and a pending verdict), read the verdict and every rank's into the
        table. A store error leaves the table as it was (stale: `explain` says the store does not answer)."""
        self._busy = True
        try:
            self.publish(beat)
            if self._pending_verdict is not None:
                self.publish_verdict(self._pending_verdict)
                self._pending_verdict = None
            if self.verdict is None:
                self.verdict = self.read_verdict()
            table = self.read_all()
        except Exception as exc:  # noqa: BLE001 - a store that went away: the table goes stale, explain() says so
            log.debug("heartbeat round failed: %s", exc)
            table = None
        with self._done:
            if table is not None:
                self._remember(self.clock(), table)
            self._busy = False
            self._rounds += 1
            self._done.notify_all()

    def beat_now(self, wait_s: float) -> bool:
        """Wake the beat thread for a round now; True when one ended within `wait_s` (never longer)."""
        if self._thread is None:
            return False
        with self._done:
            target = self._rounds + (2 if self._busy else 1)  # a round under way carries an older beat
            self._round_wanted = True
            self._wake.set()
            return self._done.wait_for(lambda: self._rounds >= target, timeout=max(0.0, wait_s))

    def post_verdict(self, text: str) -> None:
        """Have the beat thread write the job's verdict (if none is there yet) at its next round."""
        self._pending_verdict = text

    def stop(self, wait_s: float = 1.0) -> None:
        """End the beat thread (normal shutdown); a thread stuck in the store is left behind (a daemon)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _remember(self, now: float, table: Table) -> None:
        self.ok_at = now
        self.history.append((now, table))
        while len(self.history) > 2 and self.history[1][0] < now - self.keep_s:
            self.history.popleft()
        for r, b in table.items():
            if b is not None and (r not in self.seen or self.seen[r][0] != b.seq):
                self.seen[r] = (b.seq, now)

    # -- the failure's sentence, from the cache ----------------------------------------------------------------
    def explain(self, window_s: float, stale_s: float, stall_s: float, gone_only: bool = False) -> str | None:
        """Who stopped, from the cached tables (no store access): the newest against one `window_s` older; when
        the newest is older than `stale_s`, that the store does not answer and who was last seen where.
        `gone_only`: only ranks whose beat stopped (rule 1) or an unreachable store, else None."""
        with self._done:
            if not self.history:
                return None
            newest_at, after = self.history[-1]
            before = next((t for at, t in reversed(self.history) if at <= newest_at - window_s), {})
            ok_at = self.ok_at
        now = self.clock()
        if ok_at is not None and now - ok_at > stale_s:
            lost = name_stopped(before, after, self.rank, float("inf"), self.name, self.host, gone_only=True)
            return name_unreachable(after, self.seen, self.rank, now, now - ok_at, self.name, self.host,
                                    self.store_at, lost, self.store_rank)
        return name_stopped(before, after, self.rank, stall_s, self.name, self.host, gone_only)

    def peaks(self) -> dict[int, float]:
        """Every rank's last published peak device memory, GiB, from the cached table (ranks without one left
        out)."""
        table = self.history[-1][1] if self.history else {}
        return {r: b.peak_gib for r, b in table.items() if b is not None and b.peak_gib is not None}


def frozen_note(frozen: list[int], after: Table, alone: bool = False) -> str:
    """That these ranks' processes (on this node) are stopped, not dead, and what the job now waits for; `alone`:
    they are all the ranks named ('its process is stopped ...')."""
    one = len(frozen) == 1
    who = ("its" if one else "their") if alone else _join([f"rank {r}" for r in frozen]) + "'s"
    pids = ", ".join(str(after[r].pid) for r in frozen)
    return (f"{who} process{'' if one else 'es'} (pid {pids}) {'is' if one else 'are'} stopped (SIGSTOP or a "
            f"debugger); the job ends only once {'it is' if one else 'they are'} gone: a stopped process ignores "
            "SIGTERM (torchrun waits 30 s for it, then sends SIGKILL)")


def process_stopped(beat: Beat) -> bool:
    """Whether the rank of `beat` is a process on this node that is stopped (SIGSTOP, a debugger): Linux's
    /proc/<pid>/stat state T or t. False where that cannot be known (another node, no /proc, gone)."""
    if beat.pid is None or beat.node != NODE:
        return False
    try:
        with open(f"/proc/{beat.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def name_stopped(before: Table, after: Table, me: int, stall_s: float, name: Callable[[int], str],
                 host: Callable[[int], str | None] = lambda _r: None, gone_only: bool = False,
                 stopped: Callable[[Beat], bool] | None = None) -> str | None:
    """The sentence naming the rank(s) that stopped, or None when the beats show nobody (see the module
    docstring for the order of the rules)."""
    others = [r for r in after if r != me]
    gone = [r for r in others if after[r] is None or (before.get(r) is not None and after[r].end is None
                                                      and after[r].seq == before[r].seq)]
    if gone:
        return _name_gone(gone, after, me, name, host, stopped or process_stopped)
    if gone_only:
        return None
    # A rank in no wait that made no progress stopped on its own; one that has since ended, timed out on itself,
    # counts too. Only the earliest iteration's are named: with CUDA graphs the others' hosts ran on into a later
    # iteration and stopped there, their devices waiting for the rank that is behind.
    stuck = [r for r, b in after.items() if b is not None and b.waiting_on is None and b.idle_s >= stall_s]
    if stuck:
        first = min(after[r].iteration for r in stuck)
        stuck = [r for r in stuck if after[r].iteration == first]
        who = _join([name(r) for r in stuck])
        its = _join(sorted({str(after[r].iteration) for r in stuck}))
        return (f"{who} stopped in iteration {its}: no progress for {max(after[r].idle_s for r in stuck):.0f} s, "
                "waiting for no other rank")
    return _follow(after, me, name)


def _name_gone(gone: list[int], after: Table, me: int, name: Callable[[int], str],
               host: Callable[[int], str | None], stopped: Callable[[Beat], bool] = process_stopped) -> str:
    """'rank 2 (...) and rank 3 (...) stopped responding ...', led by the node when every rank of a node other
    than this rank's is among them."""
    def seen(ranks: list[int]) -> list[str]:
        return [f"{name(r)} (last seen in iteration {after[r].iteration}, {_state(after[r])})" if after[r] else
                f"{name(r)} (never published its progress)" for r in ranks]

    hosts = {r: host(r) for r in after}
    lost = sorted({hosts[r] for r in gone if hosts[r] and hosts[r] != hosts.get(me)
                   and all(x in gone for x in after if hosts[x] == hosts[r])})
    if lost:
        # Only the lost nodes' ranks go under their name: a rank elsewhere whose beat also stopped (a survivor
        # that reported and exited before its last beat went out) is named after them, apart.
        on_lost = [r for r in gone if hosts[r] in lost]
        rest = [r for r in gone if r not in on_lost]
        text = (f"{_join(lost)} lost: {_join(seen(on_lost))}, every rank on {'it' if len(lost) == 1 else 'them'}, "
                "stopped responding: the node, its network or its processes stopped")
        return f"{text}; {_join(seen(rest))} stopped responding too" if rest else text
    # A rank that was only waiting for ranks that are gone too stopped because of them (the launcher ends the
    # others once one rank fails): name the ranks that were not.
    roots = [r for r in gone if not (after[r] and after[r].waiting_on and set(after[r].waiting_on) <= set(gone))]
    roots = roots or gone
    frozen = [r for r in roots if after[r] is not None and stopped(after[r])]
    if frozen and len(frozen) == len(roots):
        return f"{_join(seen(roots))} stopped responding: {frozen_note(frozen, after, alone=True)}"
    text = f"{_join(seen(roots))} stopped responding: its process died or froze"
    return f"{text}; {frozen_note(frozen, after)}" if frozen else text


def name_unreachable(after: Table, seen: dict[int, tuple[int, float]], me: int, now: float, silent_s: float,
                     name: Callable[[int], str], host: Callable[[int], str | None], store_at: str,
                     lost: str | None, store_rank: int | None = None) -> str:
    """The store has not answered for `silent_s`: say so, who hosts it (`store_rank`'s process, when a rank's), and
    where and when each rank was last seen (ranks on one host, in one iteration, seen within a second of each other,
    grouped). A host rank whose last beat says it was exiting ended the store with it: no network is blamed."""
    groups: dict[tuple[str | None, int, int], list[int]] = {}
    for r, b in sorted(after.items()):
        if r == me or b is None:
            continue
        ago = int(round(now - seen[r][1])) if r in seen else -1
        groups.setdefault((host(r), b.iteration, ago), []).append(r)
    parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}" + (f" on {h}" if h else "")
             + f" {ago} s ago in iteration {it}" for (h, it, ago), rs in groups.items()]
    mine = host(me)
    where = f" {store_at}" if store_at else ""
    hoster = after.get(store_rank) if store_rank is not None and store_rank != me else None
    why = (f"{name(store_rank)}, which hosts it, exited after its own report" if hoster is not None and hoster.end
           else f"it stopped, or the network between it and this rank{f' (on {mine})' if mine else ''} is cut")
    text = (f"the rendezvous store{where} has not answered for {silent_s:.0f} s: {why}; last seen: "
            f"{'; '.join(parts) or 'no other rank'}")
    return f"{lost}; {text}" if lost else text


def _follow(after: Table, me: int, name: Callable[[int], str]) -> str | None:
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
