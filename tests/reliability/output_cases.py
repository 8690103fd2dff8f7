"""Output paths that are not regular files, for the reliability suite (loaded by tests/reliability/cases.py):
`cases(workdir)` returns one `Case` per output flag and kind of file, the job as forked ranks (pp=2).

A character device (reached through a symbolic link to /dev/null or /dev/full in the case's folder: the real ones
are never named) or a FIFO (read by a thread of this process) must be written into and stay what it was; one
that cannot take a write (/dev/full) or a socket must be refused in one `peerline: error:` line. A special file
replaced by a regular one is "data lost"; a FIFO reader that got nothing from a job that said it wrote is
"silent wrong".
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from tests.helpers import PIPELINE, cpu_env, forkrun_cmd
from tests.reliability.cases import STARTUP_S, TINY, Case, Result, one_clean_line, worker_traceback

READ_WAIT_S = 10.0  # how long a check waits for its FIFO's reader to reach the end of what the job wrote


class FifoReader:
    """A FIFO at `path` and a daemon thread that reads it to its end (once the job opens and closes it)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path, self.data = path, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with open(self.path, "rb") as f:
            self.data = f.read()

    def text(self) -> str:
        self.thread.join(READ_WAIT_S)
        return self.data.decode(errors="replace")


def kind_of(path: Path) -> str:
    """'link to character device', 'FIFO', 'socket', 'regular file', ... (a link followed)."""
    mode = os.stat(path).st_mode
    name = next((n for test, n in ((stat.S_ISCHR, "character device"), (stat.S_ISFIFO, "FIFO"),
                                   (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "regular file")) if test(mode)), "other")
    return f"link to {name}" if path.is_symlink() else name


def make(folder: Path, what: str) -> tuple[Path, FifoReader | None]:
    """The output path of a case: 'null' / 'full' (links to those devices), 'fifo' (with its reader), 'socket'."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / what
    if what in ("null", "full"):
        path.symlink_to(f"/dev/{what}")
        return path, None
    if what == "fifo":
        return path, FifoReader(path)
    with socket.socket(socket.AF_UNIX) as s:  # the socket file stays once the socket is closed
        s.bind(str(path))
    return path, None


def written_into(path: Path, reader: FifoReader | None, needle: str) -> Callable[[Result], str]:
    """The job ends well, the path is what it was, and a FIFO's reader got what the job wrote (`needle`)."""
    before = kind_of(path)

    def check(r: Result) -> str:
        if worker_traceback(r.out):
            return "traceback"
        if kind_of(path) != before or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
            return "data lost"
        if r.rc != 0 or r.errors:
            return "misnamed"
        if reader is not None and needle not in reader.text():
            return "silent wrong"
        return "clean"
    return check


def refused(path: Path, needle: str) -> Callable[[Result], str]:
    """One `peerline: error:` line naming the path's problem; the path is what it was."""
    before = kind_of(path)

    def check(r: Result) -> str:
        if kind_of(path) != before:
            return "data lost"
        outcome = one_clean_line(r)
        return outcome if outcome != "clean" or needle in r.errors[0] else "misnamed"
    return check


#: (flag, what the path is, None: written into (the needle a FIFO's reader must get) | str: the refusal's needle)
OUTPUTS: list[tuple[str, str, str | None, str]] = [
    ("--json", "null", None, ""),
    ("--json", "fifo", None, '"final_loss"'),
    ("--json", "full", "cannot write into this character device (No space left on device)", ""),
    ("--json", "socket", "is a socket: give a file name", ""),
    ("--metrics-jsonl", "null", None, ""),
    ("--metrics-jsonl", "fifo", None, '{"iteration": 3,'),
    ("--metrics-jsonl", "full", "cannot write into this character device (No space left on device)", ""),
]


def cases(workdir: Path) -> list[Case]:
    found = []
    for i, (flag, what, refusal, needle) in enumerate(OUTPUTS):
        here = workdir / "output_paths" / f"case{i:02d}"
        path, reader = make(here, what)
        check = written_into(path, reader, needle) if refusal is None else refused(path, refusal)
        name = f"output: {flag} {'through a link to /dev/' + what if what in ('null', 'full') else 'a ' + what}"
        found.append(Case(name, [*forkrun_cmd(2), PIPELINE, *TINY, flag, what], cpu_env(), STARTUP_S, check,
                          workdir=here))
    return found


__all__ = ["cases", "OUTPUTS", "FifoReader", "kind_of", "make", "written_into", "refused"]
