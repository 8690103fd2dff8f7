"""Watchdog: fires once with one line after the deadline, never while iterations keep finishing, and a hard exit
really ends a process whose main thread is stuck."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from peerline.distributed.resilience.watchdog import EXIT_SIGNAL, EXIT_TIMEOUT, Watchdog, _oneline, describe_edge

pytestmark = pytest.mark.timeout(60)


class Exit(Exception):
    pass


def _capture() -> tuple[int, int]:
    r, w = os.pipe()
    return r, w


def _make(timeout_s: float = 0.3, **kw):
    r, w = _capture()
    codes: list[int] = []
    done = threading.Event()

    def exit_fn(code: int) -> None:
        codes.append(code)
        done.set()

    wd = Watchdog(rank=1, stage=1, timeout_s=timeout_s, exit_fn=exit_fn, err_fd=w, poll_s=0.02, **kw)
    return wd, codes, done, r, w


def _read(r: int, w: int) -> str:
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 4096)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    return b"".join(chunks).decode()


def test_fires_once_with_one_line_naming_rank_stage_and_wait():
    wd, codes, done, r, w = _make()
    wd.start()
    wd.waiting_for(describe_edge("grad", 3, peer_rank=2, stage=1, peer_stage=2))
    assert done.wait(5), "watchdog did not fire"
    time.sleep(0.1)
    out = _read(r, w)
    assert codes == [EXIT_TIMEOUT]
    assert out == ("peerline: error: rank 1 (stage 1) timed out after 0.3 s waiting for grad mb 3 from rank 2 "
                   "(edge stage 2->1)\n")


def test_progress_keeps_it_quiet_and_suspension_pauses_it():
    wd, codes, done, r, w = _make(timeout_s=0.25)
    wd.start()
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:  # four deadlines' worth of iterations, each well inside the deadline
        time.sleep(0.05)
        wd.iteration_done()
    with wd.suspended():
        time.sleep(0.6)
    assert not codes, "fired although iterations kept finishing"
    assert done.wait(5), "did not fire after progress stopped"
    wd.stop()
    assert codes == [EXIT_TIMEOUT]
    assert "to finish" in _read(r, w)


def test_default_description_names_the_iteration():
    wd, codes, done, r, w = _make(timeout_s=0.1)
    wd.iteration_started(7)
    wd.start()
    assert done.wait(5)
    assert "timed out after 0.1 s waiting for iteration 7 to finish" in _read(r, w)


def test_probe_replaces_description_and_a_hung_probe_is_bounded():
    wd, codes, done, r, w = _make(timeout_s=0.1)
    wd.set_probe(lambda: "FULL flag of slot 2 on edge stage 0->1 never set by rank 0")
    wd.start()
    assert done.wait(5)
    assert "waiting for FULL flag of slot 2" in _read(r, w)

    wd, codes, done, r, w = _make(timeout_s=0.1)
    wd.set_probe(lambda: time.sleep(30))
    wd.waiting_for("act mb 0 from rank 0 (edge stage 0->1)")
    wd.start()
    assert done.wait(15), "a hung probe blocked the exit"
    assert "waiting for act mb 0 from rank 0" in _read(r, w)


def test_fail_reports_exception_once():
    wd, codes, done, r, w = _make(timeout_s=100)
    wd.waiting_for("act mb 0 to rank 1 (edge stage 0->1)")
    exc = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:38792. This is typically caused by a remote worker crashing. GLHF!\nmore")
    wd.fail(exc)
    wd.fail(RuntimeError("second"))  # a second failure prints nothing
    out = _read(r, w)
    assert codes == [1]
    assert out == ("peerline: error: rank 1 (stage 1) failed while waiting for act mb 0 to rank 1 (edge stage 0->1):"
                   " RuntimeError: Connection closed by peer [127.0.0.1]:38792\n")


def test_oneline_and_bad_timeout():
    assert _oneline(RuntimeError("Timed out waiting 5000ms for recv operation to complete")) == \
        "Timed out waiting 5000ms for recv operation to complete"
    assert _oneline(RuntimeError("")) == "RuntimeError"
    with pytest.raises(ValueError):
        Watchdog(0, 0, 0)


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_hard_exit_frees_a_stuck_main_thread():
    """The main thread blocks in C code (a lock that is never released); only os._exit ends the process."""
    body = """
        import threading
        from peerline.distributed.resilience.watchdog import Watchdog
        wd = Watchdog(rank=0, stage=0, timeout_s=0.5).start()
        wd.waiting_for("act mb 1 from rank 3 (edge stage 2->3)")
        lock = threading.Lock(); lock.acquire(); lock.acquire()  # never returns
    """
    t0 = time.monotonic()
    p = subprocess.run(_script(body), capture_output=True, text=True, timeout=30)
    assert p.returncode == EXIT_TIMEOUT, p.stderr
    assert time.monotonic() - t0 < 20
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("peerline:")]
    assert lines == ["peerline: error: rank 0 (stage 0) timed out after 0.5 s waiting for act mb 1 from rank 3 "
                     "(edge stage 2->3)"], p.stderr
    assert "Traceback" not in p.stderr


def test_sigterm_while_blocked_gives_one_line():
    body = """
        import sys, threading
        from peerline.distributed.resilience.watchdog import Watchdog
        wd = Watchdog(rank=2, stage=0, timeout_s=60, poll_s=0.05)
        wd.install_signal_handlers()
        wd.start()
        wd.waiting_for("grad mb 0 from rank 3 (edge stage 1->0)")
        print("ready", flush=True)
        lock = threading.Lock(); lock.acquire(); lock.acquire()
    """
    p = subprocess.Popen(_script(body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.terminate()
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == EXIT_SIGNAL, err
    assert err.strip() == ("peerline: error: rank 2 (stage 0) stopped by SIGTERM (the launcher ends the job when a "
                           "rank fails) while waiting for grad mb 0 from rank 3 (edge stage 1->0)")


def test_stop_gives_sigterm_back():
    body = """
        import os, signal, time
        from peerline.distributed.resilience.watchdog import Watchdog
        wd = Watchdog(rank=0, stage=0, timeout_s=60, poll_s=0.05)
        wd.install_signal_handlers()
        wd.start()
        wd.stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
    """
    p = subprocess.run(_script(body), capture_output=True, text=True, timeout=30)
    assert p.returncode == -15 and "survived" not in p.stdout, (p.returncode, p.stderr)


class _FakeEvent:
    """A torch.cuda.Event as device_query.EventQuery sees it: its driver handle."""

    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


class _FakeLibcuda:
    """libcuda's cuEventQuery / cuCtxGetCurrent / cuCtxSetCurrent: events by handle, done or not; a thread without
    the context is told CUDA_ERROR_INVALID_CONTEXT until it sets it."""

    def __init__(self, done: dict[int, bool]) -> None:
        self.done, self.current, self.queries = done, None, 0
        lib = self

        class Fn:
            def __init__(self, fn):
                self.fn = fn

            def __call__(self, *args):
                return self.fn(*args)

        def query(handle):
            lib.queries += 1
            if lib.current != 7:
                return 201
            return 0 if lib.done[handle] else 600

        def get_ctx(out):
            out._obj.value = 7
            return 0

        def set_ctx(ctx):
            lib.current = ctx.value
            return 0

        self.cuEventQuery, self.cuCtxGetCurrent, self.cuCtxSetCurrent = Fn(query), Fn(get_ctx), Fn(set_ctx)


def test_event_query_takes_the_main_threads_context_and_reads_the_driver_verdicts() -> None:
    """EventQuery (device_query.py) asks libcuda directly, without the GIL: a watching thread with no current
    context takes the one current where the query was made and retries; 600 is 'not yet', other errors raise."""
    from peerline.distributed.resilience.device_query import EventQuery

    lib = _FakeLibcuda({1: True, 2: False})
    q = EventQuery(lib)
    assert q.done(_FakeEvent(1)) and lib.queries == 2  # INVALID_CONTEXT, then the context, then the answer
    assert not q.done(_FakeEvent(2)) and lib.queries == 3
    lib.cuEventQuery.fn = lambda handle: 999
    with pytest.raises(RuntimeError, match="CUresult 999"):
        q.done(_FakeEvent(1))


def test_exchange_watch_names_the_first_receive_the_device_is_stuck_on() -> None:
    """describe_stall walks the receives in the order they were queued and names the first whose event has not
    completed; none pending (a host-side hang) -> None, so the watchdog keeps its own description. passed() counts
    the completed ones (the progress probe)."""
    from peerline.distributed.resilience.device_query import EventQuery
    from peerline.distributed.resilience.exchange_watch import ExchangeWatch

    wt = ExchangeWatch(links=None, watchdog=None)
    assert wt.describe_stall() is None and wt.passed() == 0
    lib = _FakeLibcuda({0: True, 1: False, 2: False})
    wt._query = EventQuery(lib)
    wt._order = [(_FakeEvent(0), "grad mb 0 from rank 1 (edge stage 1->0)"),
                 (_FakeEvent(1), "grad mb 1 from rank 1 (edge stage 1->0)"),
                 (_FakeEvent(2), "grad mb 2 from rank 1 (edge stage 1->0)")]
    assert wt.describe_stall() == "grad mb 1 from rank 1 (edge stage 1->0) (the device is stuck there)"
    assert wt.passed() == 1
    lib.done.update({1: True, 2: True})
    assert wt.describe_stall() is None and wt.passed() == 3


def test_exchange_watch_names_a_placed_message_by_its_microbatch_and_stages() -> None:
    """ZBV at pp=2 routes messages over channels and ids of the rank's two neighbours (the V turns on rank 1): the
    watchdog's line still names the message's kind, microbatch, stages and peer rank, not its channel id."""
    import torch

    from peerline.distributed.p2p.base import ACT, GRAD, Links
    from peerline.distributed.pipeline.placed import placed_schedule
    from peerline.distributed.resilience.exchange_watch import ExchangeWatch

    class Told:
        def waiting_for(self, desc, ranks=None):
            self.desc, self.ranks = desc, ranks

    placed = placed_schedule("zbv", 2, 2, 4)
    told = Told()
    # Rank 0 holds stages 0 and 3: it sends activations to rank 1 and receives stage 2's from it.
    wt = ExchangeWatch(Links(prev_rank=None, next_rank=1, act_in=None, grad_in=None), told)
    recv_label, send_label = (ACT, 2, 3), (GRAD, 2, 1)  # act of mb 3 from stage 2; stage 3's input grad of mb 1
    recv_route, send_route = placed.route(*recv_label), placed.route(*send_label)
    assert recv_route != (ACT, 3) and send_route != (GRAD, 1)  # the routes are not (kind, mb)
    wt.on_exchange([(*send_route, torch.zeros(1))], [recv_route], [send_label], [recv_label])
    assert told.desc == ("act mb 3 from rank 1 (edge stage 2->3), grad mb 1 to rank 1 (edge stage 3->2)"), told.desc
    assert told.ranks == [1]


def test_beats_publish_the_peak_memory_read_on_the_main_thread_only() -> None:
    """The allocator's statistics take its lock with the GIL held; a main thread stuck in the allocator holds
    that lock. So the memory probe runs on the calling (main) thread, when it is set and at each iteration's start
    and end, and a beat built on another thread only publishes the last reading."""
    wd = Watchdog(rank=0, stage=0, timeout_s=30, exit_fn=lambda code: None)

    class Heartbeat:
        seq = 0

        def next_seq(self) -> int:
            self.seq += 1
            return self.seq

        def nudge(self) -> None:
            pass

    wd.heartbeat = Heartbeat()
    readings = iter([1.5, 2.5, 4.0])
    callers = []

    def probe() -> float:
        callers.append(threading.current_thread())
        return next(readings)

    wd.set_memory_probe(probe)
    beats = []
    other = threading.Thread(target=lambda: beats.append(wd._beat()))
    other.start()
    other.join()
    assert beats[0].peak_gib == 1.5
    wd.iteration_started(1)
    assert wd._beat().peak_gib == 2.5
    wd.iteration_done()
    other = threading.Thread(target=lambda: beats.append(wd._beat()))
    other.start()
    other.join()
    assert beats[1].peak_gib == 4.0
    assert callers == [threading.current_thread()] * 3
