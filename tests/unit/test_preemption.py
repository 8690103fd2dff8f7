"""Preemption (resilience/preemption.py) without processes: the signal names, the agreement rounds of two ranks
through one store (threads), the cadence, the grace that reports a rank stuck away from any boundary."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.resilience import preemption
from peerline.distributed.resilience.preemption import Preemption, parse_signals, preempted_line

pytestmark = pytest.mark.timeout(60)


def _rt(rank: int, world: int) -> SimpleNamespace:
    rt = SimpleNamespace(info=SimpleNamespace(rank=rank, world_size=world), hooks=[], stop_reason=None)
    rt.request_stop = lambda reason: setattr(rt, "stop_reason", reason)
    return rt


def test_signal_names():
    assert parse_signals("TERM,usr1,SIGINT") == (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    assert parse_signals("none") == () and parse_signals("") == ()
    with pytest.raises(ConfigError, match="unknown signal 'FOO'"):
        parse_signals("TERM,FOO")
    with pytest.raises(ConfigError, match="cannot be caught"):
        parse_signals("KILL")
    with pytest.raises(ConfigError, match="'BAR' is not a signal"):
        RunConfig(preempt_signals="USR1,BAR")


@pytest.mark.parametrize("flagged", [[], [1], [0, 1]])
def test_two_ranks_agree_through_the_store(flagged):
    store = dist.HashStore()
    hooks = [Preemption(_rt(r, 2), (signal.SIGUSR1,), store=store) for r in range(2)]
    for r in flagged:
        assert hooks[r].note(signal.SIGUSR1)
    assert not hooks[0].note(signal.SIGHUP)  # not a preemption signal: left to the watchdog
    results: dict[int, bool] = {}

    def rank(r: int) -> None:
        for n in (1, 2):  # two rounds: keys of the first are deleted after the second
            results[(r, n)] = hooks[r].agree(n)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {(r, n): bool(flagged) for r in range(2) for n in (1, 2)}
    if flagged:
        who = f"SIGUSR1 on rank {flagged[0]}" if len(flagged) == 1 else "SIGUSR1 on rank "
        assert all(h.reason.startswith(f"preempted by {who}") for h in hooks)
        assert hooks[0].reason == hooks[1].reason  # one story on every rank


def test_cadence_and_the_runtime_stop():
    rt = _rt(0, 1)
    hook = Preemption(rt, (signal.SIGUSR1,), every=3)
    hook.note(signal.SIGUSR1)
    hook.after_launch(rt, 1)
    hook.after_launch(rt, 2)
    assert rt.stop_reason is None  # rounds only every 3 iterations (a launch of K crossing a multiple counts)
    hook.after_launch(rt, 4)
    assert rt.stop_reason == "preempted by SIGUSR1 on rank 0 after iteration 4"


def test_python_handler_sets_the_flag_and_is_given_back():
    rt = _rt(0, 1)
    before = signal.getsignal(signal.SIGUSR1)
    hook = Preemption(rt, (signal.SIGUSR1,))
    hook.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert hook.signalled == "SIGUSR1"
    hook.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("stopped", ["", "; rank 0 (stage 0) failed: RuntimeError: a leaf Variable"])
def test_a_rank_that_never_reaches_a_boundary_is_reported(monkeypatch, stopped):
    """A signalled rank stuck past the grace says so; where the beats name a rank that failed, the SIGTERM is the
    launcher ending the job for it (not a preemption), and the line names that rank."""
    monkeypatch.setattr(preemption, "GRACE_S", 0.2)
    fatal = threading.Event()
    seen: list[tuple[str, int]] = []
    wd = SimpleNamespace(who="rank 1 (stage 1)", description=lambda: "act mb 0 from rank 0",
                         who_stopped=lambda: stopped,
                         fatal=lambda msg, code: (seen.append((msg, code)), fatal.set()))
    rt = _rt(1, 1)
    rt.hooks = [SimpleNamespace(watchdog=wd)]
    hook = Preemption(rt, (signal.SIGTERM,))
    hook.on_train_start(rt)
    assert wd.signal_filter == hook.note
    hook.note(signal.SIGTERM)
    assert fatal.wait(5)
    why = "the launcher ends the job when a rank fails" if stopped else "preemption"
    assert seen == [(f"rank 1 (stage 1) stopped by SIGTERM ({why}) without reaching an iteration boundary in "
                     f"0.2 s, while waiting for act mb 0 from rank 0{stopped}", 128 + signal.SIGTERM)]


def test_lines():
    assert preempted_line("preempted by SIGUSR1 on rank 1 after iteration 7", "ck", 7) == (
        "peerline: preempted by SIGUSR1 on rank 1 after iteration 7: checkpoint of iteration 7 in ck; continue "
        "with --resume ck; exit 75")
    assert preempted_line("preempted by SIGTERM on rank 0 after iteration 3", None, None).endswith(
        ": nothing saved (no --save DIR); exit 75")


def test_a_long_check_interval_still_stops_at_the_next_logged_iteration():
    """--preempt-check-every 1000: no round after iteration 1, but the vote of the logged iteration stops the run."""
    rt = _rt(0, 1)
    hook = Preemption(rt, (signal.SIGUSR1,), every=1000)
    hook.on_logged(rt, SimpleNamespace(iteration=1))
    assert rt.stop_reason is None  # no signal: nothing to agree on
    hook.note(signal.SIGUSR1)
    hook.after_launch(rt, 2)
    assert rt.stop_reason is None  # no round before iteration 1000
    hook.on_logged(rt, SimpleNamespace(iteration=2))
    assert rt.stop_reason == "preempted by SIGUSR1 on rank 0 after iteration 2"


def test_the_vote_names_the_highest_signal_and_its_lowest_rank(monkeypatch):
    hooks = [Preemption(_rt(r, 4), (signal.SIGUSR1, signal.SIGTERM), every=10) for r in range(4)]
    for r, sig in ((1, signal.SIGUSR1), (3, signal.SIGTERM), (2, signal.SIGTERM)):
        hooks[r].note(sig)
    top = max(h.ballot() for h in hooks)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op: t.fill_(top))
    for h in hooks:
        rt = _rt(h.rank, 4)
        rt.engine, rt.device = SimpleNamespace(main_stream=None), "cpu"
        h.on_logged(rt, SimpleNamespace(iteration=7))
        assert rt.stop_reason == "preempted by SIGTERM on rank 2 after iteration 7"


def test_the_grace_ends_at_the_next_boundary_whatever_the_check_interval(monkeypatch):
    monkeypatch.setattr(preemption, "GRACE_S", 0.3)
    fatal = threading.Event()
    wd = SimpleNamespace(who="rank 0 (stage 0)", description=lambda: "nothing", fatal=lambda msg, code: fatal.set())
    rt = _rt(0, 1)
    rt.hooks = [SimpleNamespace(watchdog=wd)]
    hook = Preemption(rt, (signal.SIGUSR1,), every=1000)
    hook.on_train_start(rt)
    hook.note(signal.SIGUSR1)
    hook.after_launch(rt, 5)  # a boundary, not a round: the rank is not stuck
    assert not fatal.wait(0.8)


def test_a_sparse_cadence_is_said_at_start_up():
    assert preemption.cadence_notice((signal.SIGTERM,), 1000, 2) == (
        "notice: --preempt-check-every 1000 with --log-every 2: a preemption signal stops the job at the next "
        "iteration that is a multiple of 2 or 1000, not at the next one (the ranks agree on a signal there)")
    for every, log_every, sigs in ((1, 5, (signal.SIGTERM,)), (1000, 1, (signal.SIGTERM,)), (1000, 2, ())):
        assert preemption.cadence_notice(sigs, every, log_every) is None
