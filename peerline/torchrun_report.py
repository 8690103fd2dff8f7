"""torchrun's end of a peerline error: the job's `peerline: error:` line printed last, and the job's exit code.

torchrun ends every failed job with its own ChildFailedError traceback (about 45 lines) and exit code 1, whatever
its workers said; a worker's error file (TORCHELASTIC_ERROR_FILE) only feeds that traceback's summary, and the
agent has no error file of its own to copy it into. So a worker that reports an error writes its line and exit
code here (`write_error_file`: torchrun's format, with peerline's entry beside it), and this module is also an
entry point of torchrun's plugin group `torchrun.handlers` (pyproject.toml), which every torchrun loads at
start-up. In the agent process it installs an exception hook: a ChildFailedError whose failed workers wrote
peerline's entries ends with their lines, last on stderr, and the first one's exit code (2 for a bad input); any
other failure keeps torchrun's own report. The agent also sets PEERLINE_TORCHRUN_REPORTS=1, which its workers
inherit: an error at start-up (launch/messages.py) is then left to the agent, which prints it once, at the end,
unless torchrun will restart the attempt (`--max-restarts`). A failure in training is printed by the worker at
once, as it may be the last thing that rank does (the watchdog), and repeated by the agent as the last line.

Imports only the standard library and peerline.overrides: it runs inside every torchrun of the environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from peerline import overrides

#: The key of peerline's entry in a worker's error file: {"line": str, "exit_code": int, "printed": bool}.
ERROR_FILE_KEY = "peerline"
_PARENT_FILE_NOTE = "no error file defined for parent"  # torchrun's note when it has no error file of its own


@dataclass(frozen=True)
class Entry:
    """What one failed worker reported: its line, its exit code, whether it printed the line itself."""

    line: str
    exit_code: int
    printed: bool


def write_error_file(line: str, exit_code: int, printed: bool = True) -> bool:
    """This worker's torchrun error file, holding `line` and `exit_code`; False when there is none (not under
    torchrun) or it cannot be written. torchrun's structured format: its summary shows the line."""
    path = overrides.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}},
              ERROR_FILE_KEY: {"line": line, "exit_code": exit_code, "printed": printed}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        return False
    return True


def agent_prints() -> bool:
    """Whether this worker's agent prints a reported line at the end: peerline's plugin runs there and this is the
    attempt torchrun will not restart (an earlier attempt's lines would never be shown)."""
    if not overrides.get("PEERLINE_TORCHRUN_REPORTS"):
        return False
    try:
        restarts = int(overrides.get_str("TORCHELASTIC_MAX_RESTARTS", "0"))
        return int(overrides.get_str("TORCHELASTIC_RESTART_COUNT", "0")) >= restarts
    except ValueError:
        return False


def plugin() -> Callable[[Any], Any]:
    """The `torchrun.handlers` entry point: installs the report in a torchrun agent; returns the registry's
    rendezvous creator, which refuses to be used as one."""
    if is_torchrun_agent(sys.argv):
        install()
    return _not_a_backend


def _not_a_backend(params: Any) -> Any:
    raise ValueError("the rendezvous backend 'peerline' does not exist: peerline's torchrun plugin only reports "
                     "errors; use --rdzv-backend c10d")


def is_torchrun_agent(argv: list[str]) -> bool:
    """Whether this process is a torchrun agent: the torchrun script or `python -m torch.distributed.run`."""
    first = argv[0] if argv else ""
    return os.path.basename(first) == "torchrun" or first.replace(os.sep, "/").endswith("torch/distributed/run.py")


def install() -> None:
    """The exception hook, the quieted note of a peerline failure, and the mark its workers inherit."""
    previous = sys.excepthook
    sys.excepthook = lambda kind, exc, tb: report_or_pass(kind, exc, tb, previous)
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").addFilter(_quiet_note)
    overrides.assign("PEERLINE_TORCHRUN_REPORTS", "1")


def report_or_pass(kind: type[BaseException], exc: BaseException, tb: TracebackType | None,
                   previous: Callable[..., Any]) -> None:
    """A failure peerline's workers reported: their lines last on stderr, exit with the first one's code. Anything
    else: torchrun's traceback as before."""
    entries = peerline_entries(exc)
    if not entries:
        previous(kind, exc, tb)
        return
    sys.stdout.flush()
    for line in final_lines(entries):
        print(line, file=sys.stderr)
    sys.stderr.flush()
    os._exit(entries[0].exit_code)  # torchrun's workers are gone and its rendezvous closed: nothing to tear down


def final_lines(entries: list[Entry]) -> list[str]:
    """The lines the agent ends with: each line no worker printed, once, in order; when every worker printed its
    own, the first one again, so that it is the last line."""
    unprinted = [e.line for e in entries if not e.printed]
    return list(dict.fromkeys(unprinted)) or [entries[0].line]


def peerline_entries(exc: BaseException) -> list[Entry]:
    """What the failed workers wrote into peerline's entry of their error files, earliest first (by rank within a
    second); empty when `exc` is not torchrun's ChildFailedError or no failed worker wrote one."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ != "ChildFailedError" or not isinstance(failures, dict):
        return []
    ordered = sorted(failures.items(), key=lambda kv: (getattr(kv[1], "timestamp", 0), kv[0]))
    found = (read_error_file(getattr(failure, "error_file", None)) for _, failure in ordered)
    return [entry for entry in found if entry is not None]


def read_error_file(path: str | None) -> Entry | None:
    """peerline's entry in a worker's error file; None for a file torchrun or anything else wrote."""
    try:
        with open(str(path)) as f:
            entry = json.load(f).get(ERROR_FILE_KEY)
        line, code, printed = entry["line"], int(entry["exit_code"]), bool(entry.get("printed", True))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return Entry(line, code, printed) if isinstance(line, str) and 0 < code < 256 else None


def _quiet_note(record: logging.LogRecord) -> bool:
    """Drops torchrun's note that it has no error file of its own to copy a peerline worker's into."""
    if _PARENT_FILE_NOTE in str(record.msg) and record.args:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return read_error_file(str(args[0])) is None
    return True


__all__ = ["Entry", "write_error_file", "agent_prints", "plugin", "install", "is_torchrun_agent", "report_or_pass",
           "final_lines", "peerline_entries", "read_error_file", "ERROR_FILE_KEY"]
