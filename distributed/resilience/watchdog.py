"""A per-rank watchdog: no rank is ever left hanging, and every failure ends with one line that says why.

A pipeline rank can wait forever: on a peer's activation that will never come (the peer died), on an all-reduce
a replica never joins, or, on a GPU, on a stream spinning on a flag word a dead peer will never write (a
`cuStreamWaitValue32` never returns, so neither does the host's next synchronize). Only ending the process frees
such a rank. So one daemon thread per rank watches the iterations:

  wd = Watchdog(rank, stage, timeout_s).start()
  for it in ...:
      wd.waiting_for("act mb 3 from rank 0 (edge stage 0->1)")   # cheap: one attribute store, no lock
      ...
      wd.iteration_done()                                         # restarts the deadline

If no iteration finishes within `timeout_s` of the previous one (or of `arm()`), the thread writes ONE line

  peerline: error: rank R (stage S) timed out after T s waiting for <desc>

to stderr and ends the process with `os._exit(3)` (a hard exit: the main thread may be stuck inside a C call).
The description names the peer rank, so the line of a survivor names the rank that was lost. The other ranks time
out the same way, or torch.distributed's own timeout (set to the same deadline) raises: `fail(exc)` turns such an
exception into the same kind of line and exit.

Work that legitimately takes longer than an iteration (kernel compilation, CUDA-graph capture, a checkpoint save)
runs inside `with wd.suspended():`. `install_signal_handlers()` also turns the SIGTERM a launcher sends when
another rank failed (torchrun, mpirun, srun) into one line, even while the main thread is blocked in C code.
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

log = logging.getLogger(__name__)

EXIT_TIMEOUT = 3  # the watchdog's deadline passed
EXIT_FAILED = 1  # a communication error or other exception ended the rank
EXIT_SIGNAL = 128 + signal.SIGTERM  # the launcher ended the rank (as a shell reports SIGTERM)


class Watchdog:
    """Deadline on iterations for one rank; see the module docstring."""

    def __init__(self, rank: int, stage: int | None, timeout_s: float, *, exit_code: int = EXIT_TIMEOUT,
                 exit_fn: Callable[[int], None] = os._exit, err_fd: int = 2,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.rank = rank
        self.stage = stage
        self.timeout_s = float(timeout_s)
        self.exit_code = exit_code
        self._exit_fn = exit_fn  # tests replace os._exit to observe the exit without dying
        self._err_fd = err_fd
        self._clock = clock
        self._poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 20)
        self._desc = ""
        self._iteration = 0
        self._armed_at: float | None = None
        self._suspend_depth = 0
        self._probe: Callable[[], str | None] | None = None
        self._fired = threading.Lock()  # taken once: the first failure reported wins, later ones stay silent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}

    # ----------------------------------------------------------------------------------------------------------
    # what the engine calls

    def start(self) -> Watchdog:
        """Start the watching thread and arm the deadline."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"peerline-watchdog-r{self.rank}", daemon=True)
            self._thread.start()
        self.arm()
        return self

    def arm(self) -> None:
        """(Re)start the deadline now."""
        self._armed_at = self._clock()

    def disarm(self) -> None:
        """Stop watching until the next `arm()` or `iteration_done()`."""
        self._armed_at = None

    def waiting_for(self, desc: str) -> None:
        """Say what this rank is about to wait for, e.g. 'grad mb 3 from rank 1 (edge stage 1->0)'."""
        self._desc = desc

    def iteration_started(self, iteration: int) -> None:
        """Name the iteration now running (used when no finer description was given)."""
        self._iteration = iteration
        self._desc = ""

    def iteration_done(self) -> None:
        """One iteration finished: the deadline restarts."""
        self._iteration += 1
        self._desc = ""
        if self._suspend_depth == 0:
            self.arm()

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
        self._restore_signal_handlers()

    # ----------------------------------------------------------------------------------------------------------
    # failures

    @property
    def who(self) -> str:
        return f"rank {self.rank}" + (f" (stage {self.stage})" if self.stage is not None else "")

    def description(self) -> str:
        return self._desc or f"iteration {self._iteration} to finish"

    def fail(self, exc: BaseException | str, code: int = EXIT_FAILED) -> None:
        """Report an exception of the main thread (e.g. gloo's 'Connection closed by peer', a process-group
        timeout) as one line naming what this rank was waiting for, and exit. Never returns (unless exit_fn is
        replaced)."""
        if isinstance(exc, BaseException):
            what = f"{type(exc).__name__}: {_oneline(exc)}"
        else:
            what = exc
        self.fatal(f"{self.who} failed while waiting for {self.description()}: {what}", code)

    def fatal_quiet(self, code: int) -> None:
        """End the process like `fatal`, printing nothing (another rank reports the shared error)."""
        if not self._fired.acquire(blocking=False):
            return
        _run_bounded(_flush_std_streams, 2.0)
        self._stop.set()
        self._exit_fn(code)

    def fatal(self, message: str, code: int) -> None:
        """Write `peerline: error: <message>` once, flush what can be flushed, and end the process."""
        if not self._fired.acquire(blocking=False):
            # Another thread is already reporting and exiting; do not print a second line.
            if self._exit_fn is os._exit and threading.current_thread() is not self._thread:
                time.sleep(60)
            return
        line = f"peerline: error: {message}\n".encode(errors="replace")
        # Flush on a helper thread with a bound: a main thread stuck writing to a full pipe holds the stream's
        # lock, and the exit must not wait for it.
        _run_bounded(_flush_std_streams, 2.0)
        try:
            # os.write, not print/logging: the main thread may hold the locks of sys.stderr or of a log handler.
            os.write(self._err_fd, line)
        except OSError:
            pass
        self._stop.set()
        self._exit_fn(code)

    # ----------------------------------------------------------------------------------------------------------
    # signals

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
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
        name = signal.Signals(signum).name
        self.fatal(f"{self.who} stopped by {name} (the launcher ends the job when a rank fails) while waiting for "
                   f"{self.description()}", EXIT_SIGNAL)

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
                    if data:
                        self._on_signal(data[0])
                        return
            elif self._stop.wait(self._poll_s):
                return
            armed_at = self._armed_at
            if armed_at is not None and self._clock() - armed_at > self.timeout_s:
                self._on_timeout()
                return

    def _on_timeout(self) -> None:
        desc = self.description()
        probed = _run_bounded(self._probe, min(5.0, self.timeout_s)) if self._probe else None
        if probed:
            desc = probed
        self.fatal(f"{self.who} timed out after {self.timeout_s:g} s waiting for {desc}", self.exit_code)


def _run_bounded(fn: Callable[[], str | None], limit_s: float) -> str | None:
    """Call `fn` on a helper thread; give up after `limit_s` (a probe of a wedged device may block too)."""
    box: list[str | None] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # noqa: BLE001 - a failing probe must not hide the timeout itself
            log.debug("watchdog probe failed: %s", exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    return box[0] if box else None


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


def describe_edge(kind: str, mb: int, peer_rank: int | str, stage: int, peer_stage: int, *, sending: bool = False
                  ) -> str:
    """The description the engine gives `waiting_for` around a transfer, in one fixed vocabulary:
    'act mb 3 from rank 0 (edge stage 0->1)' / 'grad mb 3 to rank 0 (edge stage 1->0)'."""
    src, dst = (stage, peer_stage) if sending else (peer_stage, stage)
    return f"{kind} mb {mb} {'to' if sending else 'from'} rank {peer_rank} (edge stage {src}->{dst})"
