"""The reliability table's faults on every grid the CPU runs (issue 31): a rank killed (kill -9) or frozen
(SIGSTOP) right after an iteration, where the others wait for it in the end-of-iteration agreement (the preemption
check, a barrier in the rendezvous store). Every line must name that rank first, never the store or a live rank;
a frozen rank's line says that it is stopped and what the job then waits for.

Kinds alternate over the grids to keep the table short; the pp=2 x dp=2 kill also runs under the real torchrun
(its agent hosts the store), the rest as forked ranks (rank 0 hosts it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, torchrun_cmd
from tests.reliability.cases import STARTUP_S, TINY, Case, Result, worker_traceback

DEADLINE_S = 8
#: (grid, ranks, flags, fault kind, the rank that fails)
GRID_FAULTS = [
    ("pp=2 x dp=2", 4, ["--pp", "2", "--dp", "2"], "stop", 3),
    ("pp=4", 4, ["--pp", "4", "-m", "4"], "kill", 3),
    ("dp=2", 2, ["--dp", "2"], "stop", 1),
    ("interleaved", 4, ["--schedule", "interleaved", "--stages", "2", "-m", "4", "--layers", "8"], "kill", 3),
    ("zbv", 4, ["--schedule", "zbv", "--stages", "2", "-m", "4", "--layers", "8"], "stop", 3),
]


def names_first(rank: int, frozen: bool) -> Callable[[Result], str]:
    """Clean: the job failed, and every line's diagnosis (after the first '; ') starts with that rank, blames no
    store, and for a frozen rank says it is stopped."""
    def check(r: Result) -> str:
        if worker_traceback(r.out):
            return "traceback"
        if r.rc == 0 or not r.errors:
            return "misnamed"
        for line in r.errors:
            diagnosis = line.split("; ", 1)[1] if "; " in line else ""
            if not diagnosis.startswith(f"rank {rank} (") or "rendezvous store" in line:
                return "misnamed"
            if frozen and "is stopped (SIGSTOP" not in diagnosis:
                return "misnamed"
        return "clean"
    return check


def cases(workdir: Path) -> list[Case]:
    """One case per grid, and the pp=2 x dp=2 kill under torchrun."""
    limit = STARTUP_S + DEADLINE_S + 40
    found = []
    runs = [("forked", *g) for g in GRID_FAULTS] + [("torchrun", "pp=2 x dp=2", 4, ["--pp", "2", "--dp", "2"],
                                                     "kill", 3)]
    for launcher, grid, n, flags, kind, rank in runs:
        command = (forkrun_cmd if launcher == "forked" else torchrun_cmd)(n)
        fault = f"{kind}:rank={rank}:iter=2:at=end"
        found.append(Case(f"grid fault {launcher} {grid}: {kind} rank {rank} after iteration 2", [
            *command, PIPELINE, *TINY, "--iters", "6", "--timeout-s", str(DEADLINE_S), *flags],
            cpu_env(PEERLINE_FAULT=fault), limit, names_first(rank, frozen=kind == "stop")))
    return found
