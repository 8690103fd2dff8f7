"""Preemption: a signal asks the job to stop at the next iteration boundary, every rank agreeing, after a checkpoint.

A scheduler warns a job before it ends it (Slurm `--signal=USR1@120`, a SIGTERM before the kill, Ctrl-C through
torchrun). The signals of `--preempt-signals` (default TERM,USR1,INT) do not end a rank; they set a flag. The ranks
agree on it at launch boundaries (a graph replays whole iterations, so nothing is checked inside one):

    round n:  store.add("peerline/preempt/<n>", 1 + world * flagged)      every rank, once per launch
              the rank whose add completes the round publishes the total; everyone waits for it
              total > world: some rank was signalled -> every rank stops after iteration n

The round goes through the process group's c10d store: no device work and no host synchronization of the device,
only a host barrier per launch (`--preempt-check-every N` spaces the rounds). With N > 1 the ranks also agree on
every logged iteration (`vote`), where the loss read has synchronized them already: one all-reduce (MAX) of one
integer, the signal and the lowest signalled rank, so a signal stops every rank at the next logged boundary
whatever N. A run that logs less often than every launch (--log-every K > 1) with N > 1 says at start-up that
a signal waits for the next multiple of K or N. When every rank agrees, the runtime ends the loop
(`Runtime.request_stop`), the failsafe writes its final checkpoint (with --save), and the main job prints one line
and exits `EXIT_PREEMPTED`.

The watchdog thread reads every signal (the main thread may be blocked in C code); its `signal_filter` hands the
preemption signals here. A rank that does not reach a boundary within `GRACE_S` of its signal (blocked on a peer
that died: the launcher's SIGTERM then means "a rank failed") is reported by the watchdog as before.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from peerline.distributed.config import ConfigError
from peerline.distributed.hooks import IterationHooks, IterationStats
from peerline.distributed.streams import use

log = logging.getLogger(__name__)

#: The exit code of a preempted job (EX_TEMPFAIL of sysexits.h: "try again later"): every rank exits with it after
#: the checkpoint is written; slurm/*.sbatch requeue the job on it.
EXIT_PREEMPTED = 75
#: Seconds a signalled rank may take to reach an iteration boundary before the watchdog reports it as stopped.
GRACE_S = 20.0
PREFIX = "peerline/preempt"


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """'TERM,USR1' -> (SIGTERM, SIGUSR1); '' or 'none' -> (). A bad name is a one-line ConfigError."""
    if text.strip().lower() in ("", "none"):
        return ()
    found = []
    for name in text.split(","):
        name = name.strip().upper()
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            sig = signal.Signals[full]
        except KeyError:
            raise ConfigError(f"--preempt-signals: unknown signal {name!r}; use names such as TERM,USR1,INT") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"--preempt-signals: {full} cannot be caught")
        found.append(sig)
    return tuple(dict.fromkeys(found))


class Preemption(IterationHooks):
    """The hook: notes the signals, runs the agreement rounds at launch boundaries, asks the runtime to stop."""

    def __init__(self, rt: Any, signals: tuple[signal.Signals, ...], every: int = 1,
                 store: Any | None = None) -> None:
        self.rt = rt
        self.rank, self.world = rt.info.rank, rt.info.world_size
        self.signals = signals
        self.every = every
        multi = dist.is_initialized() and self.world > 1
        self.store = store if store is not None else (dist.distributed_c10d._get_default_store() if multi else None)
        self.signalled: str | None = None  # the name of the first signal this rank received
        self._signum: int | None = None  # its number
        self.reason: str | None = None  # set once every rank agreed to stop
        self._checked = 0  # the last iteration a round ran after
        self._timer: threading.Timer | None = None
        self._old: dict[int, Any] = {}
        self._watchdog: Any | None = None  # the failsafe's, found at the start of training

    @classmethod
    def attach(cls, rt: Any) -> Preemption:
        """A `Runtime.create` hook factory, listed before the failsafe's (so its final checkpoint is written before the
        signals are given back): reads --preempt-signals and --preempt-check-every from rt.cfg."""
        hook = cls(rt, parse_signals(rt.cfg.preempt_signals), rt.cfg.preempt_check_every)
        hook.install()
        notice = cadence_notice(hook.signals, hook.every, rt.cfg.log_every)
        if notice:
            rt.run_notices.append(notice)
        return hook

    # -- signals -------------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Handle the signals (main thread) with a Python handler, for when the main thread runs Python."""
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, lambda signum, _frame: self.note(signum))

    def on_train_start(self, rt: Any) -> None:
        """The watchdog (made by a later hook, the failsafe) reads the signals while the main thread is blocked in C
        code: its filter hands the preemption signals to `note`."""
        self._watchdog = next((h.watchdog for h in rt.hooks if hasattr(h, "watchdog")), None)
        if self._watchdog is not None and self.signals:
            self._watchdog.signal_filter = self.note

    def note(self, signum: int) -> bool:
        """A signal arrived (any thread): a preemption signal sets the flag; returns whether it was one."""
        if signum not in self.signals:
            return False
        if self.signalled is None:
            self.signalled = signal.Signals(signum).name
            self._signum = int(signum)
            log.info("%s received: stopping at the next iteration boundary", self.signalled)
            if self._watchdog is not None:
                self._timer = threading.Timer(GRACE_S, self._not_at_boundary)
                self._timer.daemon = True
                self._timer.start()
        return True

    def _not_at_boundary(self) -> None:
        """The signal came GRACE_S ago and this rank never reached a boundary: it is stuck. Where the beats show a
        rank that failed or stopped, the signal is the launcher ending the job for it, and the line names that rank."""
        wd = self._watchdog
        stopped = wd.who_stopped()
        failed = bool(stopped) and not stopped.startswith("; this rank")
        why = "the launcher ends the job when a rank fails" if failed else "preemption"
        wd.fatal(f"{wd.who} stopped by {self.signalled} ({why}) without reaching an iteration boundary in "
                 f"{GRACE_S:g} s, while waiting for {wd.description()}{stopped}", 128 + signal.SIGTERM)

    def uninstall(self) -> None:
        """Give the signals back (training is over: a later signal ends the process as usual)."""
        if self._timer is not None:
            self._timer.cancel()
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old.items():
                signal.signal(sig, old)
        self._old = {}

    # -- the rounds ------------------------------------------------------------------------------------------
    def after_launch(self, rt: Any, last_iteration: int) -> None:
        """A round when the launch crossed a multiple of --preempt-check-every (none with --preempt-signals none)."""
        if self._timer is not None:
            self._timer.cancel()  # at a boundary: from here the watchdog's deadline covers the agreement
        if not self.signals or self.reason is not None or last_iteration // self.every == self._checked // self.every:
            return
        self._checked = last_iteration
        if self.agree(last_iteration):
            rt.request_stop(self.reason)

    def on_logged(self, rt: Any, stats: IterationStats) -> None:
        """With --preempt-check-every N > 1, the vote of every logged iteration (every rank logs the same ones)."""
        if not self.signals or self.every == 1 or self.reason is not None:
            return
        if self.vote(rt, stats.iteration):
            rt.request_stop(self.reason)

    def vote(self, rt: Any, n: int) -> bool:
        """All-reduce (MAX) of this rank's signal and rank as one integer, after iteration `n` (every rank): True
        when some rank was signalled; sets `reason`, naming the highest signal's lowest rank."""
        top = self.ballot()
        if dist.is_initialized() and self.world > 1:
            with use(rt.engine.main_stream):  # never the legacy default stream
                votes = torch.tensor([top], dtype=torch.int64, device=rt.device)
                dist.all_reduce(votes, op=dist.ReduceOp.MAX)
                top = int(votes.item())
        if top == 0:
            return False
        signum, rest = divmod(top, self.world + 1)
        self.reason = f"preempted by {signal.Signals(signum).name} on rank {self.world - rest} after iteration {n}"
        return True

    def ballot(self) -> int:
        """This rank's vote: 0 unsignalled, else signal x (world + 1) + world - rank (the largest: the highest
        signal, then the lowest rank)."""
        return 0 if self._signum is None else self._signum * (self.world + 1) + self.world - self.rank

    def agree(self, n: int) -> bool:
        """One round after iteration `n` (every rank): True when any rank was signalled; sets `reason`."""
        flagged = self.signalled is not None
        if self.store is None:
            stop = flagged
            who = f"{self.signalled} on rank {self.rank}" if flagged else ""
        else:
            key = f"{PREFIX}/{n}"
            if flagged:
                self.store.set(f"{key}/who", f"{self.signalled} on rank {self.rank}")
            total = self.store.add(key, 1 + self.world * int(flagged))
            if total % self.world == 0:  # the last arrival: arrivals are 1..world, flags add multiples of world
                self.store.set(f"{key}/total", str(total))
            self.store.wait([f"{key}/total"])
            stop = int(self.store.get(f"{key}/total")) > self.world
            who = self.store.get(f"{key}/who").decode() if stop else ""
            if self.rank == 0 and self._previous is not None:
                for suffix in ("", "/total", "/who"):
                    self.store.delete_key(f"{PREFIX}/{self._previous}{suffix}")
            self._previous = n
        if stop:
            self.reason = f"preempted by {who} after iteration {n}"
        return stop

    _previous: int | None = None  # the previous round, whose keys rank 0 deletes once everyone is past it

    def on_train_end(self, rt: Any) -> None:
        self.uninstall()

    def on_error(self, rt: Any, exc: BaseException) -> None:
        self.uninstall()


def cadence_notice(signals: tuple[signal.Signals, ...], every: int, log_every: int) -> str | None:
    """The start-up notice of a run whose ranks agree on a preemption less often than every launch: with
    --preempt-check-every N > 1 they agree on logged iterations and multiples of N only."""
    if not signals or every == 1 or log_every == 1:
        return None
    return (f"notice: --preempt-check-every {every} with --log-every {log_every}: a preemption signal stops the "
            f"job at the next iteration that is a multiple of {log_every} or {every}, not at the next one (the ranks "
            "agree on a signal there)")


def preempted_line(reason: str, save_dir: str | None, saved: int | None) -> str:
    """The one line a preempted job ends with (rank 0), saying what was saved and how to continue."""
    if not save_dir:
        return f"peerline: {reason}: nothing saved (no --save DIR); exit {EXIT_PREEMPTED}"
    return (f"peerline: {reason}: checkpoint of iteration {saved} in {save_dir}; continue with --resume {save_dir}; "
            f"exit {EXIT_PREEMPTED}")
