"""--config FILE against the command line, for the reliability suite (loaded by tests/reliability/cases.py):
`cases(workdir)` returns one `Case` per conflict, the job as forked ranks (pp=2) writing its --json record.

Flags given on the command line win over the file, also over a field of the file that would set them (the file's
`global_batch` sets the micro-batch size: `--micro-batch-size` wins). A run that ends well with another value than
the command line gave is "silent wrong"; two flags that set one field differently are one `peerline: error:` line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.helpers import PIPELINE, cpu_env, forkrun_cmd
from tests.reliability.cases import STARTUP_S, TINY, Case, Result, one_clean_line, worker_traceback

#: (name, the file's text, flags after TINY (which gives --micro-batch-size 2 -m 2), the record's fields the run
#: must have, or None for a refusal whose line holds the needle)
CONFLICTS: list[tuple[str, str, list[str], dict[str, object] | None, str]] = [
    ("the file's global_batch against --micro-batch-size", "global_batch = 16\n", [],
     {"micro_batch_size": 2, "global_batch": None}, ""),
    ("the file's global_batch and microbatches against -m and --micro-batch-size",
     "global_batch = 32\nmicrobatches = 8\n", [], {"micro_batch_size": 2, "microbatches": 2, "global_batch": None},
     ""),
    ("the file's hidden against --hidden", "hidden = 16\niters = 2\n", ["--hidden", "8"],
     {"hidden": 8, "iters": 3}, ""),
    ("--global-batch against --micro-batch-size", "", ["--global-batch", "16"], None,
     "--global-batch 16 sets the micro-batch size to 16 / (dp x microbatches = 2) = 8, not --micro-batch-size 2"),
]


def _record_has(folder: Path, want: dict[str, object]) -> Callable[[Result], str]:
    def check(r: Result) -> str:
        if worker_traceback(r.out):
            return "traceback"
        if r.rc != 0 or r.errors:
            return "misnamed"
        config = json.loads((folder / "out.json").read_text())["config"]
        return "clean" if all(config.get(k) == v for k, v in want.items()) else "silent wrong"
    return check


def _refused(needle: str) -> Callable[[Result], str]:
    def check(r: Result) -> str:
        outcome = one_clean_line(r)
        return outcome if outcome != "clean" or needle in r.errors[0] else "misnamed"
    return check


def cases(workdir: Path) -> list[Case]:
    found = []
    for i, (name, text, flags, want, needle) in enumerate(CONFLICTS):
        here = workdir / "config_file" / f"case{i:02d}"
        here.mkdir(parents=True)
        (here / "run.toml").write_text(text)
        check = _record_has(here, want) if want is not None else _refused(needle)
        cmd = [*forkrun_cmd(2), PIPELINE, "--config", "run.toml", *TINY, *flags, "--json", "out.json"]
        found.append(Case(f"config: {name}", cmd, cpu_env(), STARTUP_S, check, workdir=here))
    return found


__all__ = ["cases", "CONFLICTS"]
