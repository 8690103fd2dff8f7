"""A per-rank watchdog: no rank is ever left hanging, and every failure ends with one line that says why.

A pipeline rank can wait forever: on a peer's activation that will never come (the peer died), on an all-reduce
a replica never joins, or, on a GPU, on a stream spinning on a flag word a dead peer will never write (a
`cuStreamWaitValue32` never returns, so neither does the host's next synchronize). Only ending the process frees
such a rank. So one daemon thread per rank watches the iterations:

  wd = Watchdog(rank, stage, timeout_s).start()
  for it in ...:
      wd.waiting_for("act mb 3 from rank 0 (edge stage 0->1)", ranks=(0,))   # cheap: attribute stores, no lock
      ...                                                                     # the handoff completes:
      wd.progress()                                                           # restarts the deadline
      wd.iteration_done()                                                     # restarts it too

The deadline is on progress, not on whole iterations: if no handoff, collective or iteration completes within
`timeout_s` of the last one (or of `arm()`), however long the iteration, the thread writes ONE line

  peerline: error: rank R (stage S) timed out after T s waiting for <desc>; <who stopped>

to stderr and ends the process with `os._exit(3)` (a hard exit: the main thread may be stuck inside a C call).
The description names what this rank waits for; `<who stopped>` comes from every rank's progress in the store
(heartbeat.py: a beat thread publishes this rank's each poll and caches everyone's), so with dp > 1 a rank waiting
in the all-reduce names the rank that hung, not the replica it waits with, and a lost node is named with its ranks.
Only the beat thread touches the store, whose calls have no bound (a cut-off or frozen host leaves them blocked):
the report waits for it at most a few seconds, so the hard exit comes within `EXIT_MARGIN_S` of the deadline
whatever the store does; a rank that cannot reach the store says so, and where each rank was last seen. On a GPU
the host does not see handoffs complete: a progress probe (the count of arrival events the device has passed)
counts as progress too. The other ranks time out the same
way, or torch.distributed's own timeout (a little longer) raises: `fail(exc)` turns such an exception into the same
kind of line and exit.

Work that legitimately takes longer than an iteration (kernel compilation, CUDA-graph capture, a checkpoint save)
runs inside `with wd.suspended():`. `install_signal_handlers()` also turns the SIGTERM a launcher sends when
another rank failed (torchrun, mpirun, srun), and SIGHUP and SIGINT, into one line, even while the main thread is
blocked in C code; the line says whether any rank had stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from peerline import torchrun_report
from peerline.distributed.resilience.heartbeat import Beat

log = logging.getLogger(__name__)

EXIT_TIMEOUT = 3  # the watchdog's deadline passed
EXIT_FAILED = 1  # a communication error or other exception ended the rank
EXIT_SIGNAL = 128 + signal.SIGTERM  # the launcher ended the rank (as a shell reports SIGTERM)
LINGER_S = 3.0  # how long a failing rank 0 keeps the rendezvous store up for the others' diagnosis
#: Seconds from the deadline passing (or a failure's start) to the hard exit, at most: naming who stopped, the last
#: beat, flushing, rank 0's linger. The deadline itself is noticed within one poll (at most 1 s).
EXIT_MARGIN_S = 5.0


class Watchdog:
    """Deadline on iterations for one rank; see the module docstring."""

    def __init__(self, rank: int, stage: int | list[int] | None, timeout_s: float, *,
                 exit_code: int = EXIT_TIMEOUT,
                 exit_fn: Callable[[int], None] = os._exit, err_fd: int = 2,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.rank = rank
        self.stage = stage
        self.timeout_s = float(timeout_s)
        self.exit_code = exit_code
        self._exit_fn = exit_fn  # tests replace os._exit to observe the exit without dying
        self._last_words: list[Callable[[str], None]] = []  # called with the error line's message before the exit
        self._err_fd = err_fd
        self._clock = clock
        self._poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 20)
        self._desc = ""
        self._iteration = 0
        self._armed_at: float | None = None
        self._suspend_depth = 0
        self._probe: Callable[[], str | None] | None = None
        self._waiting_on: tuple[int, ...] | None = None  # the ranks the current wait is on; None: in no wait
        self._last_progress = clock()
        self._progress_probe: Callable[[], int] | None = None
        self._probed_progress: int | None = None
        self.heartbeat: Any | None = None  # heartbeat.Heartbeat: publishes this rank's beats, names who stopped
        # This rank's peak device memory, GiB: `memory` is read on the main thread only (when set, at start, and
        # at each iteration's start and end) and the beats publish the last reading. The allocator's statistics
        # take its lock with the GIL held, and a main thread stuck in the allocator (a cudaFree behind a stream
        # that waits on a dead peer's flag) holds that lock forever: asked from the beat thread, they would
        # freeze every thread.
        self.memory: Callable[[], float | None] | None = None
        self._peak_gib: float | None = None
        self._end: str | None = None  # the failure's line, published with the last beat
        self._failing_at: float | None = None  # when the first failure report began (its exit is bounded from it)
        self._fired = threading.Lock()  # taken once: the first failure reported wins, later ones stay silent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}
        #: Consulted first for each signal the thread reads: True means it was handled elsewhere (a preemption
        #: request, resilience/preemption.py), so the watchdog neither reports it nor ends the process.
        self.signal_filter: Callable[[int], bool] | None = None

    # ----------------------------------------------------------------------------------------------------------
    # what the engine calls

    def start(self) -> Watchdog:
        """Start the watching thread and arm the deadline."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"peerline-watchdog-r{self.rank}", daemon=True)
            self._thread.start()
        self.arm()
        self._read_memory()
        if self.heartbeat is not None:  # the first beat now: a rank that dies at once has still said where it was
            self.heartbeat.start(self._beat, self._poll_s)
        return self

    def arm(self) -> None:
        """(Re)start the deadline now."""
        self._armed_at = self._clock()

    def disarm(self) -> None:
        """Stop watching until the next `arm()` or `iteration_done()`."""
        self._armed_at = None

    def waiting_for(self, desc: str, ranks: tuple[int, ...] | list[int] | None = None) -> None:
        """Say what this rank is about to wait for, e.g. 'grad mb 3 from rank 1 (edge stage 1->0)', and on which
        ranks (published in the beats: who waits for whom names the rank that stopped)."""
        self._desc = desc
        self._waiting_on = tuple(ranks) if ranks is not None else ()  # (): in a wait, on ranks not known

    def progress(self) -> None:
        """A handoff or collective completed: the deadline restarts, and this rank is in no wait."""
        self._last_progress = self._clock()
        self._waiting_on = None
        if self._armed_at is not None and self._suspend_depth == 0:
            self._armed_at = self._last_progress

    def set_progress_probe(self, probe: Callable[[], int] | None) -> None:
        """A counter of device-side progress (arrival events passed) the thread polls: a change is progress."""
        self._progress_probe = probe

    def iteration_started(self, iteration: int) -> None:
        """Name the iteration now running (used when no finer description was given); the beat thread publishes
        it soon, not at its next round only."""
        self._iteration = iteration
        self._desc = ""
        self._waiting_on = None
        self._read_memory()
        if self.heartbeat is not None:
            self.heartbeat.nudge()

    def iteration_done(self) -> None:
        """One iteration finished: the deadline restarts."""
        self._iteration += 1
        self._desc = ""
        self._waiting_on = None
        self._last_progress = self._clock()
        self._read_memory()
        if self._suspend_depth == 0:
            self.arm()

    def set_memory_probe(self, probe: Callable[[], float | None] | None) -> None:
        """This rank's peak device memory in GiB, read now and at each iteration's start and end (main thread)."""
        self.memory = probe
        self._read_memory()

    def _read_memory(self) -> None:
        """Read this rank's peak memory (main thread: see `memory`)."""
        if self.memory is not None:
            try:
                self._peak_gib = self.memory()
            except Exception:  # noqa: BLE001 - a beat without memory figures is still a beat
                self._peak_gib = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No deadline inside (compilation, graph capture, checkpoint I/O); re-armed on exit."""
        self._suspend_depth += 1
        self.disarm()
        try:
            yield
        finally:
            self._suspend_depth -= 1
            if self._suspend_depth == 0:
                self.arm()

    def set_probe(self, probe: Callable[[], str | None] | None) -> None:
        """A function that can say, at timeout, what the device is stuck on (e.g. which flag word of which edge
        is unset); called from the watchdog thread with a short bound, its answer replaces the description."""
        self._probe = probe

    def stop(self) -> None:
        """End the watching thread (normal shutdown)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self.heartbeat is not None:
            self.heartbeat.stop(1.0)
        self._restore_signal_handlers()

    # ----------------------------------------------------------------------------------------------------------
    # failures

    @property
    def who(self) -> str:
        return f"rank {self.rank}" + (f" ({stage_label(self.stage)})" if self.stage is not None else "")

    def description(self) -> str:
        return self._desc or f"iteration {self._iteration} to finish"

    def fail(self, exc: BaseException | str, code: int = EXIT_FAILED) -> None:
        """Report an exception of the main thread (e.g. gloo's 'Connection closed by peer', a process-group
        timeout) as one line naming what this rank was waiting for, and exit. Never returns (unless exit_fn is
        replaced)."""
        self._failing()
        if isinstance(exc, BaseException):
            what = f"{type(exc).__name__}: {_oneline(exc)}"
            log.debug("%s: the failure's traceback", self.who, exc_info=exc)  # PEERLINE_LOG=DEBUG shows where
        else:
            what = exc
        desc = self.description()
        self.fatal(f"{self.who} failed while waiting for {desc}: {what}{self._who_stopped()}", code)

    @property
    def verdict(self) -> str | None:
        """The job's first diagnosis, as the beat thread last read it from the store (None: none yet)."""
        return self.heartbeat.verdict if self.heartbeat is not None else None

    def _failing(self) -> float:
        """The time by which this failure's report must be done (set by the first failure)."""
        if self._failing_at is None:
            self._failing_at = self._clock()
        return self._failing_at + EXIT_MARGIN_S

    def _left(self, cap: float) -> float:
        """Seconds this failure's report may still spend on one step, at most `cap`."""
        return max(0.0, min(cap, self._failing() - self._clock()))

    def who_stopped(self) -> str:
        """What the beats say of the rank that stopped or failed ('; rank 1 (stage 1) ...'), '' when nothing is
        known; bounded like a failure's report (it starts one)."""
        return self._who_stopped()

    def _who_stopped(self) -> str:
        """'; rank 1 (stage 1) stopped responding: ...' from every rank's cached beats (one fresh beat round if it
        comes within 2 s), or '; the rendezvous store ... has not answered ...', or '' when nothing is known."""
        idle = self._clock() - self._last_progress
        if self._waiting_on is None and self._desc == "" and idle >= min(self.timeout_s, 60.0):  # known here
            return (f"; this rank stopped in iteration {self._iteration}: no progress for {idle:.0f} s, waiting for "
                    "no other rank")
        hb = self.heartbeat
        if hb is None:
            return ""
        window_s = max(2.2 * self._poll_s, 2.0)  # a rank whose beat did not advance in this long stopped
        stale_s, stall_s = max(3 * self._poll_s, 2.0), min(self.timeout_s / 2, 30.0)
        # A failure right after a peer died (its connection reset) comes before its beat is a window old: take
        # fresh tables until a rank is seen gone or a window has passed, within the report's budget.
        settle = min(self._failing() - EXIT_MARGIN_S + window_s + 0.5 * self._poll_s, self._failing() - 1.5)
        hb.beat_now(self._left(2.0))  # a fresh table (and this rank's beat) if the store answers at once
        found = hb.explain(window_s, stale_s, stall_s, gone_only=True)
        while found is None and self._clock() < settle:
            hb.beat_now(max(0.0, min(self._poll_s, settle - self._clock())))
            found = hb.explain(window_s, stale_s, stall_s, gone_only=True)
        found = found or hb.explain(window_s, stale_s, stall_s)
        if found and "rendezvous store" not in found:
            hb.post_verdict(found)  # written by the beat thread: for ranks failing later, after the store's host
        elif hb.verdict:
            # The job's first diagnosis leads; what this rank named from its stale table before the store part
            # says the same or less.
            at = found.find("the rendezvous store") if found else -1
            found = f"{hb.verdict}; {found[at:]}" if at >= 0 else f"{hb.verdict}; {found}" if found else hb.verdict
        return f"; {found}" if found else ""

    def add_last_words(self, fn: Callable[[str], None]) -> None:
        """Call fn(message) when this watchdog ends the process with an error line (e.g. the bench records the
        failed measurement); bounded in time, its own failures ignored."""
        self._last_words.append(fn)

    def _say_last_words(self, message: str) -> None:
        for fn in self._last_words:
            run_bounded(lambda fn=fn: fn(message), 2.0)

    def fatal_quiet(self, code: int) -> None:
        """End the process like `fatal`, printing nothing (another rank reports the shared error)."""
        if not self._fired.acquire(blocking=False):
            return
        run_bounded(_flush_std_streams, 1.0)
        self._stop.set()
        self._exit_fn(code)

    def fatal(self, message: str, code: int) -> None:
        """Write `peerline: error: <message>` once, flush what can be flushed, and end the process."""
        if not self._fired.acquire(blocking=False):
            # Another thread is already reporting and exiting; do not print a second line.
            if self._exit_fn is os._exit and threading.current_thread() is not self._thread:
                time.sleep(60)
            return
        until = self._failing()
        self._end = message
        if self.heartbeat is not None:  # the last beat says why this rank exits (others: not a frozen rank)
            self.heartbeat.beat_now(self._left(0.5))
        line = f"peerline: error: {message}\n".encode(errors="replace")
        # Flush on a helper thread with a bound: a main thread stuck writing to a full pipe holds the stream's
        # lock, and the exit must not wait for it.
        run_bounded(_flush_std_streams, self._left(0.5))
        try:
            # os.write, not print/logging: the main thread may hold the locks of sys.stderr or of a log handler.
            os.write(self._err_fd, line)
        except OSError:
            pass
        torchrun_report.write_error_file(f"peerline: error: {message}", code)  # torchrun prints it last
        self._say_last_words(message)
        if self.heartbeat is not None and self.rank == 0 and self._exit_fn is os._exit:
            # Rank 0 may host the store: the others are still reading it to name who stopped.
            time.sleep(max(0.0, min(LINGER_S, until - self._clock())))
        self._stop.set()
        self._exit_fn(code)

    # ----------------------------------------------------------------------------------------------------------
    # signals

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
                                ) -> None:
        """Report the signals a launcher sends when another rank failed as one line and exit 128+SIGTERM.

        The Python-level handler only runs when the main thread returns to the interpreter, which a rank blocked
        in a collective never does; so the signal number is written to a wakeup pipe that the watchdog thread
        reads. Call from the main thread, before `start()`."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._old_handlers = {sig: signal.signal(sig, lambda _s, _f: None) for sig in signals}  # the thread acts
        self._wake_r, self._wake_w = r, w

    def _restore_signal_handlers(self) -> None:
        """Give the signals back (after a normal end, SIGTERM must end the process again)."""
        if self._wake_r is None or threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = None
        self._old_handlers = {}

    def _on_signal(self, signum: int) -> None:
        self._failing()
        name = signal.Signals(signum).name
        desc = self.description()
        stopped = self._who_stopped()
        failed = bool(stopped) or self.heartbeat is None  # without beats, the launcher's usual reason
        why = {signal.SIGHUP: "the terminal or launcher hung up", signal.SIGINT: "interrupted"}.get(
            signum, "the launcher ends the job when a rank fails" if failed else "sent by the launcher or a user")
        if not failed:
            stopped = "; no rank had stopped"
        self.fatal(f"{self.who} stopped by {name} ({why}) while waiting for {desc}{stopped}", 128 + signum)

    # ----------------------------------------------------------------------------------------------------------
    # the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake_r is not None:
                ready, _, _ = select.select([self._wake_r], [], [], self._poll_s)
                if ready:
                    try:
                        data = os.read(self._wake_r, 64)
                    except BlockingIOError:
                        data = b""
                    unhandled = [sig for sig in data if not (self.signal_filter and self.signal_filter(sig))]
                    if unhandled:
                        self._on_signal(unhandled[0])
                        return
            elif self._stop.wait(self._poll_s):
                return
            self._poll_progress()
            armed_at = self._armed_at
            if armed_at is not None and self._clock() - armed_at > self.timeout_s:
                self._on_timeout()
                return

    def _poll_progress(self) -> None:
        """Device-side progress (a GPU's arrival events) restarts the deadline like the host's."""
        if self._progress_probe is None:
            return
        count = run_bounded(self._progress_probe, min(1.0, self.timeout_s / 4))
        if count is not None and count != self._probed_progress:
            if self._probed_progress is not None:
                self.progress()
            self._probed_progress = count

    def _beat(self) -> Beat:
        """This rank's beat now (called by the beat thread, heartbeat.py, every poll); no device call."""
        return Beat(self.heartbeat.next_seq(), self._iteration, self._waiting_on, self.description(),
                    self._clock() - self._last_progress, self._end, self._peak_gib)

    def _on_timeout(self) -> None:
        self._failing()
        desc = self.description()
        probed = run_bounded(self._probe, self._left(1.0)) if self._probe else None
        if probed:
            desc = probed
        self.fatal(f"{self.who} timed out after {self.timeout_s:g} s waiting for {desc}{self._who_stopped()}",
                   self.exit_code)


def run_bounded(fn: Callable[[], Any], limit_s: float, fallback: Any = None) -> Any:
    """Call `fn` on a helper thread; give up after `limit_s` (a probe of a wedged device may block too) and
    return `fallback`."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # noqa: BLE001 - a failing probe must not hide the timeout itself
            log.debug("watchdog probe failed: %s", exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    return box[0] if box else fallback


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort before a hard exit
            pass
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    return None


def _oneline(exc: BaseException) -> str:
    """First line of an exception, without the C++ source location gloo/NCCL put in front, up to its first
    sentence ('Connection closed by peer [127.0.0.1]:38792')."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", lines[0])
    head = re.split(r"\.\s", text, maxsplit=1)[0]
    return head.rstrip(".") or text


def stage_label(stages: int | list[int]) -> str:
    """'stage 1', or 'stages 0, 3' for a rank that holds several (interleaved and zbv placements)."""
    stages = [stages] if isinstance(stages, int) else list(stages)
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


def describe_edge(kind: str, mb: int, peer_rank: int | str, stage: int, peer_stage: int, *, sending: bool = False
                  ) -> str:
    """The description the engine gives `waiting_for` around a transfer, in one fixed vocabulary:
    'act mb 3 from rank 0 (edge stage 0->1)' / 'grad mb 3 to rank 0 (edge stage 1->0)'."""
    src, dst = (stage, peer_stage) if sending else (peer_stage, stage)
    return f"{kind} mb {mb} {'to' if sending else 'from'} rank {peer_rank} (edge stage {src}->{dst})"
