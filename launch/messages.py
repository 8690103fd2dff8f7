"""The main job's one-line messages: an error shown once per job, the start-up notices, the log format.

An error is one `peerline: error: <message>` line on stderr, exit code 2. Before any process group exists every
rank checks the same input and fails alike, so rank 0 alone prints it; the other ranks wait a short grace (torchrun
and mpirun end them as soon as rank 0 exits) and exit silently. A rank's own error (its GPU) and any error after
the process group exists are printed by each rank that has it, unless the ranks agreed on it first (the failsafe's
start-up checks: the lowest failing rank prints, the others raise `ReportedElsewhere` and exit silently). Under
torchrun the printing rank also writes the line to its TORCHELASTIC_ERROR_FILE, in torchrun's own format (its
failure summary shows the line) with peerline's entry beside it: peerline's torchrun plugin
(peerline/torchrun_report.py) then prints that line last, in place of torchrun's traceback, and exits with its code.
Where the agent runs that plugin (PEERLINE_TORCHRUN_REPORTS) and will not restart the attempt, the line goes to
the error file only, so it shows once, at the end.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time

import torch

from peerline import overrides, torchrun_report
from peerline.distributed.config import ReportedElsewhere, RunConfig
from peerline.distributed.env import RankConfigError, group_started, launch_rank_world

ERROR_GRACE_S = 2.0


def error_line(message: str) -> str:
    return f"peerline: error: {message}"


def write_error_file(line: str, exit_code: int = 2, printed: bool = True) -> bool:
    """torchrun's error file for this worker, holding `line` (peerline/torchrun_report.py); True when written."""
    return torchrun_report.write_error_file(line, exit_code, printed)


def report_error(message: str, exc: BaseException | None = None) -> None:
    """Print the error line where it belongs (see the module docstring); the caller exits 2."""
    rank, world = launch_rank_world()
    job_wide = not group_started() and not isinstance(exc, RankConfigError)
    if isinstance(exc, ReportedElsewhere):
        pass  # another rank prints this error
    elif rank == 0 or not job_wide:
        line = error_line(message)
        # Under an agent that prints reported lines at the end (peerline/torchrun_report.py): written for it only.
        if not (torchrun_report.agent_prints() and write_error_file(line, printed=False)):
            print(line, file=sys.stderr, flush=True)
            write_error_file(line)
    if world > 1 and not (job_wide and rank == 0):
        # torchrun stops the other ranks as soon as one exits: the grace lets the ranks that print reach their line.
        time.sleep(ERROR_GRACE_S)


class _Format(logging.Formatter):
    """`peerline: <level>: <message>`, with `[rank R] ` in front when the job has several ranks."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        line = f"{self.prefix}peerline: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:  # a traceback asked for (PEERLINE_LOG=DEBUG): below the line
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging() -> None:
    """One log format for the main job (level from PEERLINE_LOG)."""
    rank, world = launch_rank_world()
    handler = logging.StreamHandler()
    handler.setFormatter(_Format(f"[rank {rank}] " if world > 1 else ""))
    try:
        level = overrides.log_level()
    except ValueError:
        level = "WARNING"  # the command line's check (launch/cli.py) reports the bad value as one line
    logging.basicConfig(level=level, handlers=[handler], force=True)


# GPU-only flag values given on the CPU: what each would have done.
_CPU_IGNORED = (
    ("p2p", "copy-engine", "--p2p copy-engine is ignored on the CPU (copy-engine handoffs need GPUs); using gloo"),
    ("kernels", "peerline", "--kernels peerline is ignored on the CPU (they are CUDA kernels); using torch's"),
    ("allocator", "async", "--allocator async is ignored on the CPU (it is a CUDA allocator)"),
    ("staging", "pinned", "--staging pinned is ignored on the CPU (nothing to copy to a device): no pinned memory "
                          "or copy streams"),
)


def cpu_notices(cfg: RunConfig) -> list[str]:
    """One notice per GPU-only flag value on the CPU (--graph and --graph-loop say so in the graph policy)."""
    return [text for field, value, text in _CPU_IGNORED if getattr(cfg, field) == value]


def gpu_extra() -> str:
    """The install extra of this torch's CUDA major version."""
    major = (torch.version.cuda or "13").split(".")[0]
    return f"peerline[cuda{major}]" if major in ("12", "13") else "peerline[cuda13]"


def gpu_notices(cfg: RunConfig) -> list[str]:
    """One notice per missing GPU extra: what the run falls back to, and the extra that brings it."""
    extra, notices = gpu_extra(), []
    if importlib.util.find_spec("cupy") is None and cfg.kernels != "torch":
        notices.append(f"notice: CuPy not installed: torch's kernels instead of peerline's; pip install '{extra}'")
    if _missing("cuda.bindings") and cfg.p2p != "nccl":
        notices.append("notice: cuda-bindings not installed: NCCL handoffs instead of the copy engine, no looped "
                       f"graphs; pip install '{extra}'")
    return notices


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # the parent package (cuda) is missing
        return True


def start_notices(cfg: RunConfig, device: torch.device) -> list[str]:
    """The notices of this run's device: GPU-only flags ignored on the CPU, or GPU extras missing on a GPU."""
    if device.type == "cuda":
        return gpu_notices(cfg)
    return [f"notice: {text}" for text in cpu_notices(cfg)]


__all__ = ["report_error", "error_line", "write_error_file", "setup_logging", "start_notices", "cpu_notices",
           "gpu_notices", "gpu_extra", "ERROR_GRACE_S"]
