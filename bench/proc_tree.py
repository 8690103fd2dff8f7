"""A job run as a process tree that can be ended whole: bench/isolation.py's jobs (torchrun and its ranks).

torchrun starts every rank in a session of its own, so ending torchrun's process group leaves the ranks running; a
rank spinning in a device-side flag wait also ignores everything but a signal. So a job is ended by walking its
tree (/proc: every process whose parent chain leads to the job), sending SIGTERM to all of it, then SIGKILL to what
is left after a grace. This process becomes a child subreaper (Linux), so a rank orphaned by its launcher is
re-parented here and is still found, and `leftovers(before)` after a job names anything it left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
TERM_GRACE_S = 5.0


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process /proc shows (empty without /proc)."""
    parents: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return parents
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
        if len(fields) > 2 and fields[0] != "Z":  # a zombie has ended already
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every living process below `pid`, parents first."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children.get(p, [])
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill_and_reap(pids: list[int], grace_s: float) -> None:
    """SIGKILL to `pids`; wait up to `grace_s` until none lives, and collect those that were (or became, as
    subreaper) this process's children, so they do not stay as zombies."""
    _signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        alive = _parents()
        if not any(p in alive for p in pids):
            break
        time.sleep(0.05)
    reap(pids)


def end_tree(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> int:
    """End `proc` and every process below it: SIGTERM to all, SIGKILL to what is left after `grace_s`. Returns how
    many processes were signalled."""
    tree = [proc.pid, *descendants(proc.pid)]
    _signal_all(tree, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    tree += [p for p in descendants(proc.pid) if p not in tree]
    _kill_and_reap([p for p in tree if p != proc.pid], grace_s)
    proc.kill()
    proc.wait()
    return len(tree)


def leftovers(before: set[int]) -> list[int]:
    """Processes below this one that were not there `before` (a finished job's ranks orphaned here, as subreaper)."""
    return [p for p in descendants(os.getpid()) if p not in before]


def end_leftovers(before: set[int], grace_s: float = TERM_GRACE_S) -> int:
    """SIGKILL to what a finished job left below this process (anything not there `before`); how many there were."""
    left = leftovers(before)
    _kill_and_reap(left, grace_s)
    return len(left)


def reap(pids: list[int]) -> None:
    """Collect those of `pids` that ended as this process's children (never another child's status)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
