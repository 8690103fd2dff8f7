"""Naming the rank that stopped from every rank's beats (distributed/resilience/heartbeat.py), on a real store, and
from the cached table when the store is cut off (its calls block: the beat thread alone waits for them)."""

from __future__ import annotations

import datetime
import random
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from peerline.distributed.resilience.heartbeat import (
    NODE,
    Beat,
    Heartbeat,
    name_stopped,
    own_connection,
    process_stopped,
)


def name(r: int) -> str:
    return f"rank {r} (stage {r % 2})"


def beat(seq: int, on: tuple[int, ...] | None, idle: float = 0.0, it: int = 3, end: str | None = None) -> Beat:
    return Beat(seq, it, on, "something" if on else "", idle, end)


def test_a_rank_whose_beat_stopped_is_named_first():
    before = {0: beat(1, (1,)), 1: beat(5, None), 2: beat(1, (3,)), 3: beat(1, (1,))}
    after = {0: beat(2, (1,)), 1: beat(5, None), 2: beat(2, (3,)), 3: beat(2, (1,))}
    got = name_stopped(before, after, 2, 5.0, name)
    assert got.startswith("rank 1 (stage 1) (last seen in iteration 3, in no wait) stopped responding"), got


def test_a_rank_gone_while_waiting_only_for_a_gone_rank_is_not_named():
    """pp=2 x dp=2, rank 1 killed: the launcher then ends rank 3, which was waiting for rank 1 alone in the
    gradient all-reduce; both beats stopped, only rank 1 is named (it waited for rank 0, which is alive)."""
    before = {0: beat(1, (1,)), 1: beat(4, (0, 3)), 2: beat(1, (3,)), 3: beat(6, (1,))}
    after = {0: beat(2, (1,)), 1: beat(4, (0, 3)), 2: beat(2, (3,)), 3: beat(6, (1,))}
    got = name_stopped(before, after, 0, 5.0, name)
    assert got.startswith("rank 1 (stage 1) (last seen in iteration 3") and "rank 3" not in got, got


def test_a_live_rank_in_no_wait_that_made_no_progress_is_named_not_the_replica_waited_for():
    """pp=2 x dp=2: rank 3 waits for rank 1 in the all-reduce, rank 2 for rank 3; rank 1 hangs outside any wait."""
    before = {0: beat(1, (1,), 6), 1: beat(1, None, 7), 2: beat(1, (3,), 6), 3: beat(1, (1,), 6)}
    after = {r: Beat(b.seq + 1, b.iteration, b.waiting_on, b.desc, b.idle_s + 1, b.end) for r, b in before.items()}
    got = name_stopped(before, after, 2, 5.0, name)
    assert got == "rank 1 (stage 1) stopped in iteration 3: no progress for 8 s, waiting for no other rank"


def test_the_chain_of_waits_leads_to_the_rank_that_waits_for_nobody():
    before = {0: beat(1, (1,)), 1: beat(1, None, 1.0), 2: beat(1, (3,)), 3: beat(1, (1,))}
    after = {r: Beat(b.seq + 1, b.iteration, b.waiting_on, b.desc, b.idle_s, b.end) for r, b in before.items()}
    assert name_stopped(before, after, 2, 5.0, name) == ("rank 1 (stage 1) stopped in iteration 3, waiting for no "
                                                         "other rank")
    cycle = {0: beat(2, (1,)), 1: beat(2, (0,)), 2: beat(2, (0,)), 3: beat(2, (2,))}
    assert name_stopped(cycle, {r: beat(3, b.waiting_on) for r, b in cycle.items()}, 3, 5.0, name) == (
        "rank 3 (stage 1), rank 2 (stage 0), rank 0 (stage 0) and rank 1 (stage 1) wait for each other")


def test_a_rank_that_reported_and_exited_is_not_frozen():
    before = {0: beat(1, (1,)), 1: beat(4, None, 9.0, end="timed out")}
    after = {0: beat(2, (1,)), 1: beat(4, None, 9.0, end="timed out")}
    assert "stopped responding" not in (name_stopped(before, after, 0, 5.0, name) or "")


def test_beats_round_trip_through_a_store():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    hb = [Heartbeat(store, r, 2, name) for r in range(2)]
    hb[0].publish(Beat(hb[0].next_seq(), 2, (1,), "grad mb 0 from rank 1", 0.5, None, 1.5))
    beats = hb[1].read_all()
    assert beats[1] is None and beats[0].waiting_on == (1,) and beats[0].peak_gib == 1.5
    assert hb[1].peaks() == {}  # from the cached table: none read yet
    hb[1].round(Beat(hb[1].next_seq(), 2, None, "", 0.1))
    assert hb[1].peaks() == {0: 1.5}
    hb[1].publish_verdict("rank 1 (stage 1) stopped")
    hb[0].publish_verdict("a later diagnosis")
    assert hb[0].read_verdict() == "rank 1 (stage 1) stopped"


def test_every_rank_of_a_lost_node_is_named_with_the_node():
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    before = {r: beat(5, (r + 1,) if r < 3 else None) for r in range(4)}
    after = {**before, 0: beat(6, (1,)), 1: beat(6, (2,))}
    got = name_stopped(before, after, 0, 5.0, lambda r: f"rank {r} (stage {r}, on {hosts[r]})", hosts.get)
    assert got.startswith("node2 lost: rank 2 (stage 2, on node2) (last seen in iteration 3, waiting for "), got
    assert "rank 3 (stage 3, on node2) (last seen in iteration 3, in no wait), every rank on it, stopped " in got
    # one rank of a node that still has live ones: that rank only, not its node
    after[3] = beat(6, None)
    got = name_stopped(before, after, 0, 5.0, lambda r: f"rank {r}", hosts.get)
    assert got.startswith("rank 2 (last seen") and "node2" not in got, got


class CutStore:
    """A store whose calls block while `cut` is set, as a TCPStore's do when its host's network is gone."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.inner.set_timeout(datetime.timedelta(seconds=5))
        self.open = threading.Event()
        self.open.set()

    def __getattr__(self, op: str):
        def call(*args):
            self.open.wait()
            return getattr(self.inner, op)(*args)
        return call


def test_a_cut_off_store_leaves_the_cached_table_and_says_where_each_rank_was_last_seen():
    store = CutStore()
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    others = [Heartbeat(store, r, 4, str) for r in (0, 1, 3)]
    for it, hb in enumerate(others):
        hb.publish(Beat(hb.next_seq(), 7 + it, None, "", 0.0))
    me = Heartbeat(store, 2, 4, lambda r: f"rank {r}", hosts.get, store_at="at 10.0.0.1:29500, hosted by rank 0")
    me.start(lambda: Beat(me.next_seq(), 9, (1, 3), "the loss all-reduce", 0.0), period_s=0.05)
    try:
        assert me.beat_now(2.0) and me.peaks() == {}
        # the store answers: the others' beats do not advance here, but none is older than the window yet
        assert me.explain(5.0, stale_s=0.5, stall_s=5.0) == "rank 1 stopped in iteration 8, waiting for no other rank"
        store.open.clear()  # the link is cut: every store call of the beat thread now blocks
        time.sleep(0.1)
        t0 = time.monotonic()
        assert not me.beat_now(0.3) and time.monotonic() - t0 < 0.6  # bounded, whatever the store does
        time.sleep(0.6)
        got = me.explain(0.2, stale_s=0.5, stall_s=5.0)
        assert got.startswith("the rendezvous store at 10.0.0.1:29500, hosted by rank 0 has not answered for "), got
        assert "or the network between it and this rank (on node2) is cut; last seen: " in got, got
        assert "rank 0 on node1 " in got and " ago in iteration 7" in got and "rank 3 on node2 " in got, got
    finally:
        store.open.set()
        me.stop()


def test_a_new_iteration_is_published_soon_and_names_where_a_dead_rank_was():
    """The watchdog nudges the beat thread at every iteration: with a 5 s period, ten quick iterations reach the
    store within a second, and a rank that then dies is last seen in iteration 10, not in its start-up beat's 0."""
    from peerline.distributed.resilience.watchdog import Watchdog

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    wd = Watchdog(1, 1, timeout_s=100.0, poll_s=5.0)
    wd.heartbeat = Heartbeat(store, 1, 2, name)
    wd.start()
    try:
        last = random.randint(5, 12)
        for it in range(1, last + 1):
            wd.iteration_started(it)
            time.sleep(0.01)
        t0 = time.monotonic()
        while Beat.from_json(store.get("peerline/beat/1").decode()).iteration != last:
            assert time.monotonic() - t0 < 1.0, "the nudged beat did not come"
            time.sleep(0.02)
    finally:
        wd.stop()  # the rank is gone: its beat stays as it was
    now = [0.0]
    reader = Heartbeat(store, 0, 2, name, clock=lambda: now[0])
    reader.round(Beat(reader.next_seq(), last, (1,), "act mb 0 to rank 1", 0.0))
    now[0] = 3.0
    reader.round(Beat(reader.next_seq(), last + 1, (1,), "act mb 0 to rank 1", 0.0))
    got = reader.explain(window_s=2.0, stale_s=10.0, stall_s=5.0)
    assert got == f"rank 1 (stage 1) (last seen in iteration {last}, in no wait) stopped responding: its process " \
                  "died or froze", got


def test_beats_go_on_while_the_main_thread_waits_in_the_store():
    """Issue 31: the preemption check is a barrier in the store; a TCPStore client runs one call at a time for every
    thread that shares it, so the beats stopped behind the barrier of a rank that died, and the survivors named each
    other and the store. The beat thread's own connection (`own_connection`) keeps them going."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=3),
                           wait_for_workers=False)
    store = dist.PrefixStore("attempt0", server)  # as env.py opens it
    barrier = threading.Thread(target=lambda: _quietly(lambda: store.wait(["peerline/preempt/2/total"])),
                               daemon=True)
    barrier.start()
    time.sleep(0.2)  # the main thread is in the barrier, waiting for a rank that never comes
    hb = Heartbeat(own_connection(store), 0, 2, name)
    done = threading.Event()
    threading.Thread(target=lambda: (hb.round(Beat(hb.next_seq(), 2, None, "", 0.0)), done.set()),
                     daemon=True).start()
    assert done.wait(1.5), "the beat waited for the barrier"
    assert hb.history[-1][1][0].seq == 1  # published and read back
    barrier.join(5)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the barrier's timeout
        pass


def test_a_stopped_process_is_named_as_such_with_what_the_job_waits_for():
    """Issue 31: after a SIGSTOP the survivors' lines come on time, but the launcher then waits for the stopped rank
    (torchrun: 30 s after its SIGTERM); the line says so. A process that is gone is not called stopped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        frozen = Beat(4, 2, None, "", 0.0, pid=child.pid, node=NODE)
        while not process_stopped(frozen) and time.monotonic() < deadline:
            time.sleep(0.02)
        before = {0: beat(1, (1,)), 1: frozen}
        after = {0: beat(2, (1,)), 1: frozen}
        got = name_stopped(before, after, 0, 5.0, name)
        assert got.startswith("rank 1 (stage 1) (last seen in iteration 2, in no wait) stopped responding: its "
                              f"process (pid {child.pid}) is stopped (SIGSTOP or a debugger); the job ends only once "
                              "it is gone: a stopped process ignores SIGTERM (torchrun waits 30 s"), got
        assert not process_stopped(Beat(4, 2, None, "", 0.0, pid=child.pid, node="another-node"))
    finally:
        child.kill()
        child.wait()
    assert not process_stopped(frozen)  # gone
    assert name_stopped(before, after, 0, 5.0, name).endswith("stopped responding: its process died or froze")


def test_a_hung_rank_that_ended_itself_is_named_not_the_ranks_that_ran_ahead_under_graphs():
    """pp=2 x dp=2 with CUDA graphs, rank 1's host hangs before iteration 6 and its own watchdog ends it; the other
    hosts enqueued iteration 6's replay and stopped in iteration 7, in no wait the beats know (their devices spin
    on rank 1's flags). Rank 1 is named, alone."""
    before = {0: beat(1, None, 10.0, it=7), 1: beat(4, None, 11.0, it=6, end="timed out; this rank stopped"),
              2: beat(1, None, 10.0, it=7), 3: beat(1, None, 10.0, it=7)}
    after = {r: Beat(b.seq + (0 if b.end else 1), b.iteration, None, "", b.idle_s + 2, b.end)
             for r, b in before.items()}
    got = name_stopped(before, after, 0, 5.0, name)
    assert got == "rank 1 (stage 1) stopped in iteration 6: no progress for 13 s, waiting for no other rank", got
