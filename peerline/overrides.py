"""Every environment variable peerline reads or sets, documented in one table and accessed only here.

Configuration comes from RunConfig and its command line; the environment only overrides a few defaults (the
PEERLINE_* variables below), tunes kernels and transports for experiments, and tells a process who it is (the
launcher's variables). Product code reads them through this module, never through `os.environ`, so the table is
the complete list and `--help` shows it (`describe()`). An unset or empty variable means its default.

    overrides.get("PEERLINE_FAULT")                   -> str | None
    overrides.get_int("PEERLINE_P2P_SPLIT_MIN", 1 << 20)
    overrides.environment()                           -> a read-only view for code that takes a mapping

This module imports nothing from peerline, so any layer (kernels/, distributed/, launch/) may use it.
"""

from __future__ import annotations

import os
import textwrap
import types
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Override:
    """One variable: its name, its default as shown to users, and what it changes."""

    name: str
    default: str
    meaning: str


OVERRIDES: tuple[Override, ...] = (
    Override("PEERLINE_DEVICE", "auto", "default of --device"),
    Override("PEERLINE_ALLOCATOR", "none", "default of --allocator (read before torch loads)"),
    Override("PEERLINE_LOG", "WARNING", "logging level of the main job: DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    Override("PEERLINE_FAULT", "none", "faults to inject, e.g. kill:rank=1:iter=3"),
    Override("PEERLINE_KERNEL_PLANS", "none", "OP[:DTYPE][:l2]=PLAN,... over the tuned plans; 'default': none"),
    Override("PEERLINE_KERNEL_WARPS", "8", "compute warps of the elementwise kernels"),
    Override("PEERLINE_KERNEL_STAGES", "2", "pipeline stages of the elementwise kernels"),
    Override("PEERLINE_KERNEL_TILE", "0", "chunks per tile of the elementwise kernels (0: the rule)"),
    Override("PEERLINE_KERNEL_DIRECT", "0", "1: compute warps store results straight from registers"),
    Override("PEERLINE_KERNEL_VEC", "1", "16-byte vectors per chunk of the elementwise kernels (1 or 2)"),
    Override("PEERLINE_KERNEL_LOADER", "0", "0: cp.async loads, 1: cp.async.bulk (sm_90)"),
    Override("PEERLINE_KERNEL_STORER", "0", "0: st.global per lane, 1: cp.async.bulk per tile"),
    Override("PEERLINE_KERNEL_GELU", "1", "how bias+GELU evaluates Phi (kernels/compile.py GELU_*)"),
    Override("PEERLINE_KERNEL_LINEINFO", "0", "1: compile kernels with -lineinfo (compute-sanitizer)"),
    Override("PEERLINE_ATTENTION", "auto", "fused RoPE attention: auto (torch SDPA's pick), flash, cudnn, cudnn-ops"),
    Override("PEERLINE_GRAPH_MEMSETS", "kernels",
             "small memset nodes of a captured iteration: kernels (replaced by kernel nodes) or keep"),
    Override("PEERLINE_P2P_BATCH", "1", "0: one driver call per copy-engine flag operation"),
    Override("PEERLINE_P2P_SPLIT_MIN", "1048576", "bytes below which --p2p-split sends a message whole"),
    Override("PEERLINE_HOST_ID", "host name", "this rank's host for the per-edge transport; a,a,b,b: one per rank"),
    Override("CUDA_DEVICE_MAX_CONNECTIONS", "32", "hardware queues; peerline sets 32 unless set, warns below 4"),
    Override("PYTORCH_CUDA_ALLOC_CONF", "torch's", "allocator settings; --allocator writes its backend entry"),
    Override("KINETO_LOG_LEVEL", "6", "torch.profiler's log level; --profile sets 6 (no USDT/STAGE lines) unless set"),
)

#: Set by torchrun, Slurm or MPI: facts about the launch, read to find rank, world and rendezvous address.
LAUNCH_VARIABLES: tuple[str, ...] = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID",
    "SLURM_STEPID", "SLURM_NNODES", "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_MAX_RESTARTS",
    "PEERLINE_TORCHRUN_REPORTS",  # set by peerline's torchrun plugin (peerline/torchrun_report.py) in the agent
)

#: Read to choose between a progress bar and plain lines: a dumb (or unknown) terminal gets plain lines.
TERMINAL_VARIABLES: tuple[str, ...] = ("TERM",)

_KNOWN = frozenset(o.name for o in OVERRIDES) | frozenset(LAUNCH_VARIABLES) | frozenset(TERMINAL_VARIABLES)


def _known(name: str) -> str:
    if name not in _KNOWN:
        raise KeyError(f"{name} is not a documented peerline environment variable (peerline/overrides.py)")
    return name


def get(name: str) -> str | None:
    """The value of a documented variable; None when it is unset or empty."""
    return os.environ.get(_known(name)) or None


def get_str(name: str, default: str) -> str:
    """The value of a documented variable, else `default`."""
    value = get(name)
    return default if value is None else value


def get_int(name: str, default: int) -> int:
    """The value of a documented variable as an integer, else `default` (ValueError when not an integer)."""
    value = get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """PEERLINE_LOG as a logging level name (any case), WARNING when unset; ValueError naming the choices."""
    value = get_str("PEERLINE_LOG", "WARNING").strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"environment variable PEERLINE_LOG={get('PEERLINE_LOG')!r} is not a logging level; "
                         f"choose one of {', '.join(LOG_LEVELS)}")
    return value


def set_default(name: str, value: str) -> None:
    """Set a documented variable for this process and its children unless it is already set."""
    os.environ.setdefault(_known(name), value)


def assign(name: str, value: str | None) -> None:
    """Set a documented variable for this process and its children; None or '' removes it."""
    if value:
        os.environ[_known(name)] = value
    else:
        os.environ.pop(_known(name), None)


def environment() -> Mapping[str, str]:
    """The process environment as a read-only mapping, for readers that take one so tests can pass their own
    (launcher detection by presence of LAUNCH_VARIABLES, fault specs); they read documented names only."""
    return types.MappingProxyType(os.environ)


def describe() -> str:
    """The table as text for `--help`: one line per override, then the launcher's variables."""
    width = max(len(o.name) for o in OVERRIDES) + 2
    shown = max(len(o.default) for o in OVERRIDES) + 2
    lines = ["environment (overrides; an unset or empty variable keeps its default):",
             f"  {'variable':<{width}}{'default':<{shown}}meaning"]
    lines += [f"  {o.name:<{width}}{o.default:<{shown}}{o.meaning}" for o in OVERRIDES]
    launch = ("launcher variables read: " + ", ".join(LAUNCH_VARIABLES) + "; and " + ", ".join(TERMINAL_VARIABLES)
              + " (a progress bar or plain lines)")
    lines += textwrap.wrap(launch, width=116, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


__all__ = ["Override", "OVERRIDES", "LAUNCH_VARIABLES", "TERMINAL_VARIABLES", "get", "get_str", "get_int",
           "log_level", "LOG_LEVELS", "set_default", "assign", "environment", "describe"]
