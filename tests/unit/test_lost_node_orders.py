"""Issue 31: a node cut off is named as lost by the ranks left on the other node, whatever order the timeouts fire in.

pp=4 over two nodes: ranks 0, 1 on node1 (rank 0 hosts the rendezvous store), ranks 2, 3 on node2, whose link is cut
at t = 0. The line of rank 1 (or rank 0) is built by the real watchdog and heartbeat on a simulated clock: every
beat round is one poll of simulated time (`SimHeartbeat.beat_now`), the other ranks' beats advance in a dict store
while they are alive, and the store raises once its host has exited. No sleeps, no threads.
"""

from __future__ import annotations

import os
import signal

import pytest

from peerline.distributed.resilience.heartbeat import VERDICT, Beat, Heartbeat
from peerline.distributed.resilience.watchdog import Watchdog

HOSTS = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
POLL_S = 0.5  # the watchdog's poll at --timeout-s 10
LOST = "node2 lost: rank 2 (stage 2, on node2) (last seen in iteration 12"
THEN = "rank 3 (stage 3, on node2) (last seen in iteration 12"


def name(r: int) -> str:
    return f"rank {r} (stage {r}, on {HOSTS[r]})"


class SimStore:
    """The keys of the rendezvous store; every call raises once its host (rank 0) has exited."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.gone = False

    def _up(self) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._up()
        self.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._up()
        return self.keys[key]

    def check(self, keys: list[str]) -> bool:
        self._up()
        return all(k in self.keys for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._up()
        return [self.keys[k] for k in keys]


class SimJob:
    """Simulated time, the store, and the other ranks' beats: each poll, every rank still beating publishes one."""

    def __init__(self, me: int) -> None:
        self.now, self.me, self.store = 0.0, me, SimStore()
        self.beating = {r for r in HOSTS if r != me}
        self.seq = dict.fromkeys(HOSTS, 0)
        self.end: dict[int, str] = {}
        self.events: list[tuple[float, object]] = []  # (time, what happens then), applied as time passes

    def at(self, t: float, what: object) -> None:
        self.events.append((t, what))
        self.events.sort(key=lambda e: e[0])

    def tick(self) -> None:
        self.now = round(self.now + POLL_S, 6)
        while self.events and self.events[0][0] <= self.now:
            self.events.pop(0)[1]()
        if self.store.gone:
            return
        for r in sorted(self.beating):
            self.seq[r] += 1
            it = 12 if r >= 2 else 13
            self.store.keys[f"peerline/beat/{r}"] = Beat(self.seq[r], it, None, "", 0.0, self.end.get(r),
                                                         node=HOSTS[r], pid=1000 + r).to_json().encode()


class SimHeartbeat(Heartbeat):
    """The heartbeat of the rank under test: `beat_now` is one poll of simulated time and one round."""

    def __init__(self, job: SimJob) -> None:
        super().__init__(job.store, job.me, len(HOSTS), name, HOSTS.get, clock=lambda: job.now,
                         store_at="at node1:29500, hosted by rank 0 (stage 0, on node1)", store_rank=0)
        self.job = job

    def beat_now(self, wait_s: float) -> bool:
        self.job.tick()
        self.round(Beat(self.next_seq(), 13, (self.job.me + 1,), "grad mb 0", 0.0, node=HOSTS[self.job.me], pid=1))
        return True

    def run_until(self, t: float) -> None:
        while self.job.now < t:
            self.beat_now(POLL_S)


def line_of(job: SimJob, report: str) -> str:
    """The error line rank `job.me` writes at the current simulated time: `report` is 'timeout' (its own deadline),
    'gloo' (an exception of its main thread) or 'sigterm' (its launcher ends it once another rank exited)."""
    r, w = os.pipe()
    codes: list[int] = []
    wd = Watchdog(job.me, job.me, 10.0, exit_fn=codes.append, err_fd=w, clock=lambda: job.now, poll_s=POLL_S)
    wd.heartbeat = job.hb
    wd.waiting_for(f"grad mb 0 from rank {job.me + 1}", ranks=(job.me + 1,))
    if report == "timeout":
        wd._on_timeout()
    elif report == "gloo":
        wd.fail(RuntimeError("Connection reset by peer"))
    else:
        wd._on_signal(signal.SIGTERM)
    os.close(w)
    text = os.read(r, 65536).decode()
    os.close(r)
    assert codes and text.count("\n") == 1, text
    return text.strip()


def job_for(me: int) -> SimJob:
    job = SimJob(me)
    job.hb = SimHeartbeat(job)
    job.hb.run_until(2.0)  # every rank beats for a while
    job.at(job.now + 0.1, lambda: job.beating.difference_update({2, 3}))  # node2 cut off
    return job


def rank0_reports_and_exits(job: SimJob, at: float, last_beat: bool = True) -> None:
    """Rank 0 posts its verdict and, with `last_beat`, its ending beat; 3 s later (its linger) the store goes."""
    def report() -> None:
        verdict = f"{LOST}, in no wait) and {THEN}, in no wait), every rank on it, stopped responding: the node, its " \
                  "network or its processes stopped"
        job.store.keys.setdefault(VERDICT, verdict.encode())
        if last_beat:
            job.end[0] = "timed out"
    job.at(at, report)
    job.at(at + 3.0, lambda: (setattr(job.store, "gone", True), job.beating.discard(0)))


@pytest.mark.parametrize("report", ["timeout", "gloo", "sigterm"])
def test_a_report_long_after_the_cut_names_the_node(report: str) -> None:
    job = job_for(1)
    job.hb.run_until(12.0)
    got = line_of(job, report)
    assert LOST in got and THEN in got and "rendezvous store" not in got, got


@pytest.mark.parametrize("report", ["gloo", "timeout"])
def test_a_report_right_at_the_cut_waits_for_the_beats_to_show_the_node(report: str) -> None:
    """The main thread fails a tenth of a second after the cut (gloo first): the beats of node2 are not yet a window
    old; the report takes fresh tables until they are, within its budget."""
    job = job_for(1)
    job.hb.run_until(job.now + 0.1)
    got = line_of(job, report)
    assert LOST in got and THEN in got, got
    found = got.split("; ", 1)[1]
    assert "rank 0" not in found and "rank 1" not in found, got


@pytest.mark.parametrize("late_s", [0.2, 1.0, 6.0])
def test_the_store_gone_after_its_host_reported_still_names_the_node(late_s: float) -> None:
    """Rank 0 (the store's host) times out first, reports node2 and exits after its linger; rank 1 reports
    `late_s` later (its launcher's SIGTERM, or its own deadline): within the staleness limit from its last table,
    past it from its history and the verdict, never naming rank 0, and the lost node once."""
    job = job_for(1)
    rank0_reports_and_exits(job, at=10.5)
    job.hb.run_until(13.5 + late_s)
    got = line_of(job, "sigterm")
    assert got.count("node2 lost") == 1 and LOST in got and THEN in got, got
    assert "rank 0 (stage 0, on node1) (last seen" not in got, got
    if "rendezvous store" in got:  # past the staleness limit: the store went with its host, no network is blamed
        assert " s: rank 0 (stage 0, on node1), which hosts it, exited after its own report; last seen: " in got, got


def test_a_survivor_that_exited_without_its_last_beat_is_not_named_as_on_the_lost_node() -> None:
    """Rank 1 (node1) reported and exited before its ending beat went out; rank 0 reports 4 s later: node2 is
    lost with its own ranks; rank 1 is named apart, on node1."""
    job = job_for(0)
    job.hb.run_until(10.0)
    job.beating.discard(1)
    job.hb.run_until(14.0)
    got = line_of(job, "timeout")
    found = got.split("; ", 1)[1]
    assert found.startswith(LOST), got
    lost, rest = found.split("every rank on it", 1)
    assert "rank 1" not in lost and "rank 1 (stage 1, on node1) (last seen in iteration 13" in rest, got
