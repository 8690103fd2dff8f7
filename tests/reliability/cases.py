"""The reliability suite's table: each bad input as forked ranks (some also under torchrun and mpirun), each
fault on pp=2 (forked ranks) and pp=2 x dp=2 (torchrun).

A case is a command line and what a clean outcome looks like; its check sorts what happened into one of
clean / traceback / hang / silent wrong / misnamed / data lost (see OUTCOMES). More cases join the table from the
modules of GROUPS that exist (each module's `cases(workdir)` returns more `Case`s): checkpoint attacks, output
paths that are not regular files, export_checkpoint's bad inputs, --config against the command line, a rank killed
or frozen on every grid the CPU runs.
PEERLINE_RELIABILITY_CASES=<text>[,<text>...] keeps the cases whose name holds one of the texts (a group is built
only when a text starts with its name): `PEERLINE_RELIABILITY_CASES=export: pytest tests/reliability`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.forkjob import split_command
from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, mpirun_cmd, run_command, torchrun_cmd

#: silent wrong: the job ended as if all went well but did something else than it was asked (a flag ignored).
OUTCOMES = ("clean", "traceback", "hang", "silent wrong", "misnamed", "data lost")
#: The modules whose cases join the table, by the name their cases start with.
GROUPS = {"checkpoint": "checkpoint_cases.py", "output": "output_cases.py", "export": "export_cases.py",
          "config": "config_cases.py", "grid fault": "grid_fault_cases.py"}
TINY = ["--hidden", "8", "--layers", "4", "--seq", "4", "--micro-batch-size", "2", "-m", "2", "--iters", "3",
        "--device", "cpu"]
STARTUP_S = 90  # torch imports of every rank on a loaded 2-core machine, the rendezvous

#: (name, arguments, environment): each must end the job with one `peerline: error:` line, no traceback.
BAD_INPUTS: list[tuple[str, list[str], dict[str, str]]] = [
    ("lr nan", ["--lr", "nan"], {}),
    ("lr inf", ["--lr", "inf"], {}),
    ("timeout nan", ["--timeout-s", "nan"], {}),
    ("timeout inf", ["--timeout-s", "inf"], {}),
    ("timeout 1e300", ["--timeout-s", "1e300"], {}),
    ("bucket nan", ["--bucket-mb", "nan"], {}),
    ("first bucket inf dp=2", ["--first-bucket-mb", "inf", "--dp", "2"], {}),
    ("seed 10**30", ["--seed", str(10**30)], {}),
    ("hidden 10**12", ["--hidden", str(10**12)], {}),
    ("seq 10**9", ["--seq", str(10**9)], {}),
    ("micro-batch-size 10**9", ["--micro-batch-size", str(10**9)], {}),
    ("global batch -8", ["--global-batch", "-8"], {}),
    ("global batch 0", ["--global-batch", "0"], {}),
    ("unknown flag", ["--no-such-flag"], {}),
    ("not a number", ["--layers", "many"], {}),
    ("PEERLINE_LOG=BOGUS", [], {"PEERLINE_LOG": "BOGUS"}),
    ("fault at a missing rank", [], {"PEERLINE_FAULT": "kill:rank=5:iter=2"}),
    ("model :f", ["--model", ":f"], {}),
    ("model .rel:f", ["--model", ".rel:f"], {}),
    ("model syntax error", ["--model", "syntax_error:make"], {}),
    ("model raises on import", ["--model", "raises_on_import:make"], {}),
    ("factory KeyboardInterrupt", ["--model", "bad_models:interrupted"], {}),
    ("factory sys.exit(7)", ["--model", "bad_models:exits"], {}),
    ("model without parameters", ["--model", "bad_models:no_parameters"], {}),
    ("wrong width", ["--model", "bad_models:wrong_width"], {}),
    ("tuple output", ["--model", "bad_models:tuple_output"], {}),
    ("int64 output", ["--model", "bad_models:int64_output"], {}),
    ("complex output", ["--model", "bad_models:complex_output"], {}),
    ("feed returns floats", ["--model", "gpt", "--data", "bad_models:feed_returns_floats"], {}),
    ("feed writes floats", ["--model", "gpt", "--data", "bad_models:feed_floats_in_place"], {}),
    ("feed ids out of range", ["--model", "gpt", "--data", "bad_models:feed_out_of_range"], {}),
    ("data ''", ["--data", ""], {}),
    ("sidecar float64", ["--model", "gpt", "--data", "float64.bin"], {}),
    ("layer builder raises on one rank", ["--model", "bad_models:builder_raises"], {}),
    ("weight shared by two stages", ["--model", "bad_models:shared_across_stages"], {}),
    ("loss returns a vector", ["--loss", "bad_models:vector_loss"], {}),
    ("loss returns an int", ["--loss", "bad_models:int_loss"], {}),
    ("lr 100 diverges", ["--lr", "100"], {}),
    ("timeout 0.001", ["--timeout-s", "0.001"], {}),
]

#: (name, PEERLINE_FAULT, the rank that stops): every rank out within the deadline, every line naming that rank.
FAULTS = [("kill", "kill:rank=1:iter=2", 1), ("hang", "hang:rank=1:iter=2", 1)]
#: (grid, ranks, flags, launcher): torchrun's agent ends the survivors of a fault (SIGTERM) before their own
#: deadlines; pp=2 x dp=2 has pp=2's survivor (rank 0, waiting on rank 1) and more, so pp=2 runs as forked ranks.
GRIDS = [("pp=2", 2, [], "forked"), ("pp=2 x dp=2", 4, ["--dp", "2"], "torchrun")]
FAULT_TIMEOUT_S = 8


@dataclass
class Case:
    name: str
    cmd: list[str]
    env: dict[str, str]
    limit_s: float
    check: Callable[[Result], str]  # the outcome of a finished run (a hang is found by the runner)
    workdir: Path | None = None


@dataclass
class Result:
    rc: int | None
    out: str
    seconds: float
    errors: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, rc: int | None, out: str, seconds: float) -> Result:
        return cls(rc, out, seconds, [ln for ln in out.splitlines() if ln.startswith("peerline: error:")])


def write_models(workdir: Path) -> None:
    """The bad models: bad_models.py, and two modules that cannot be imported (written here: a file with a
    syntax error would break the linter)."""
    (workdir / "bad_models.py").write_text((Path(__file__).parent / "bad_models.py").read_text())
    (workdir / "syntax_error.py").write_text("def make(:\n    pass\n")
    (workdir / "raises_on_import.py").write_text("raise RuntimeError('no model here')\n")
    (workdir / "float64.bin").write_bytes(bytes(range(64)) * 8)  # a token file whose sidecar says float64
    (workdir / "float64.json").write_text('{"dtype": "float64", "vocab": 256, "count": 64, "max_id": 255}')


def worker_traceback(out: str) -> bool:
    """A Python traceback from a rank. torchrun's own ChildFailedError traceback, which it prints for every
    failed job whatever the workers said, is not one."""
    blocks = out.split("Traceback (most recent call last)")[1:]
    return any("ChildFailedError" not in block.split("\n\n")[0] for block in blocks)


def one_clean_line(r: Result) -> str:
    if worker_traceback(r.out):
        return "traceback"
    if r.rc == 0 and not r.errors:
        return "silent wrong"  # the job went on as if the input were fine (a shared weight, a diverging loss)
    if r.rc == 0 or len(r.errors) != 1:
        return "misnamed"  # no line, or one per rank, or a job that did not fail
    return "clean"


def last_line_exit_2(r: Result) -> str:
    """Under torchrun: one clean line, and it is the last line of the job's output with exit code 2 (peerline's
    torchrun plugin, peerline/torchrun_report.py, in place of torchrun's traceback and exit 1)."""
    outcome = one_clean_line(r)
    if outcome != "clean":
        return outcome
    lines = [ln for ln in r.out.splitlines() if ln.strip()]
    return "clean" if r.rc == 2 and lines[-1] == r.errors[0] else "misnamed"


def names_rank(rank: int) -> Callable[[Result], str]:
    def check(r: Result) -> str:
        if worker_traceback(r.out):
            return "traceback"
        who = f"rank {rank} (stage 1"
        if r.rc == 0 or not r.errors or any(who not in line for line in r.errors):
            return "misnamed"
        return "clean"
    return check


#: Every bad input runs as forked ranks (tests/forkjob.py: torchrun's variables, a fraction of the start-up cost).
#: Under the real torchrun, whose plugin (peerline/torchrun_report.py) prints an error at start-up once, at the end,
#: and one in training as the worker's and the agent's last line: the environment, a model factory, a model's
#: output. A flag's value and argparse run under torchrun in tests/multiproc/test_newcomer_launch.py, a grid check
#: and a factory's result in test_pipeline_cpu.py, each with the same last-line and exit-code check.
UNDER_TORCHRUN = ("PEERLINE_LOG=BOGUS", "model raises on import", "tuple output")
#: Under mpirun the check is the forked ranks' (one line); what differs is that ranks learn their rank from Open MPI's
#: variables and mpirun ends the others: one input before the process group on rank 0 alone (argparse), one read
#: from the environment, one a model factory, one in training after the process group (a model's output).
UNDER_MPIRUN = ("unknown flag", "PEERLINE_LOG=BOGUS", "model raises on import", "tuple output")


def launcher(kind: str, n: int) -> list[str]:
    return {"torchrun": torchrun_cmd, "mpirun": mpirun_cmd, "forked": forkrun_cmd}[kind](n)


def selection() -> list[str]:
    """The texts of PEERLINE_RELIABILITY_CASES (none: every case)."""
    return [t.strip() for t in os.environ.get("PEERLINE_RELIABILITY_CASES", "").split(",") if t.strip()]


def all_cases(workdir: Path) -> list[Case]:
    """The table: the bad inputs, the faults, and the cases of GROUPS; only those PEERLINE_RELIABILITY_CASES
    selects."""
    texts = selection()
    cases = [c for c in base_cases(workdir) if not texts or any(t in c.name for t in texts)]
    for group, file_name in GROUPS.items():
        path = Path(__file__).parent / file_name
        if path.exists() and (not texts or any(t.startswith(group) for t in texts)):
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            cases += [c for c in module.cases(workdir) if not texts or any(t in c.name for t in texts)]
    return cases


def base_cases(workdir: Path) -> list[Case]:
    """The bad inputs (under torchrun and mpirun where UNDER_TORCHRUN and UNDER_MPIRUN say) and the faults."""
    assert set(UNDER_TORCHRUN) | set(UNDER_MPIRUN) <= {name for name, _, _ in BAD_INPUTS}
    cases = []
    env_models = {"PYTHONPATH": f"{workdir}:{Path(__file__).resolve().parents[2]}"}
    under = {"forked": {name for name, _, _ in BAD_INPUTS}, "torchrun": set(UNDER_TORCHRUN),
             "mpirun": set(UNDER_MPIRUN)}
    for kind in ("forked", "torchrun", "mpirun"):
        for name, args, env in BAD_INPUTS:
            if name in under[kind]:
                check = last_line_exit_2 if kind == "torchrun" else one_clean_line
                cases.append(Case(f"{kind}: {name}", [*launcher(kind, 2), PIPELINE, *TINY, *args],
                                  cpu_env(**env_models, **env), STARTUP_S, check))
    for grid, n, args, kind in GRIDS:
        for name, fault, rank in FAULTS:
            limit = STARTUP_S + FAULT_TIMEOUT_S + 40
            cases.append(Case(f"{kind} {grid}: {name} rank {rank}", [
                *launcher(kind, n), PIPELINE, *TINY, "--iters", "6", "--timeout-s", str(FAULT_TIMEOUT_S), *args],
                cpu_env(PEERLINE_FAULT=fault), limit, names_rank(rank)))
    return cases


def run_case(case: Case, workdir: Path) -> tuple[str, Result]:
    """Run one case to its outcome; past its limit the job is killed and the outcome is a hang."""
    cwd = case.workdir or workdir
    t0 = time.monotonic()
    if split_command(case.cmd):
        try:
            done = run_command(case.cmd, cwd, case.env, case.limit_s)
        except subprocess.TimeoutExpired as exc:
            return "hang", Result.of(None, f"{exc.stdout or ''}{exc.stderr or ''}", time.monotonic() - t0)
        result = Result.of(done.returncode, done.stdout + done.stderr, time.monotonic() - t0)
        return case.check(result), result
    p = subprocess.Popen(case.cmd, cwd=cwd, env=case.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=case.limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return "hang", Result.of(None, out, time.monotonic() - t0)
    result = Result.of(p.returncode, out, time.monotonic() - t0)
    return case.check(result), result


__all__ = ["Case", "Result", "OUTCOMES", "GROUPS", "all_cases", "run_case", "write_models", "one_clean_line",
           "worker_traceback"]
