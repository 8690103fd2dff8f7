"""`launch/bench.py SUITE --isolate`: every measurement as a job of its own, so a failing or hung one ends alone.

A peerline variant that fails on one rank or stops in a device-side wait ends its whole job (the watchdog; no host
can release a rank spinning on a flag), so the bench can go on only from outside that job. Here one process (rank
0 under torchrun, whose other ranks leave at once; or a plain `python launch/bench.py ... --isolate --ranks N`)
runs each suite as a series of jobs, each `torchrun --standalone --nproc_per_node=N launch/bench.py <the same
arguments> --isolated-child DIR` in a session of its own, its output in DIR/log.txt:

- the pipeline and gpt suites (PER_MEASUREMENT) one job per measurement (an anchor with all its candidates, each
  peerline schedule x variant, each recompute setting): each job runs the suite, measures the first measurement not
  done yet and replays the others from the ledger of results (bench/isolation_child.py), so ratios against the
  anchor and `best` records still come out; a suite whose anchor failed says so in its notes and records none;
- every other suite whole, as one job.

A job that exits with an error is noted as `FAILED <measurement>: <its rank's error line>`; one still running
after --isolate-timeout-s is ended with its whole process tree (bench/proc_tree.py) and noted as not finished;
nothing it started is left running. Then the next measurement runs. Progress lines name each measurement, i of n
(n as known so far) and the time since the bench started; a job running long prints a line every minute. The
results merge into one results.jsonl / results.md (bench/isolation_report.py) with measurements.jsonl beside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peerline.bench import proc_tree
from peerline.bench.isolation_child import LEDGER, RESULT, STARTED
from peerline.bench.isolation_report import MergedResults

PER_MEASUREMENT = ("pipeline", "gpt")
POLL_S = 0.5
PROGRESS_EVERY_S = 60.0
#: a launcher's variables: the jobs' own torchrun sets them anew (PEERLINE_TORCHRUN_REPORTS: the plugin's, per agent)
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "PEERLINE_TORCHRUN_REPORTS")
_ERROR_LINE = re.compile(r"peerline: error: (.*)")
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "bench.py"


def launched_rank() -> tuple[int, int, int]:
    """(rank, world size, local world size) of the launcher that started this process ((0, 1, 1) alone)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return int(env.get("RANK", "0")), world, int(env.get("LOCAL_WORLD_SIZE", str(world)))


def job_ranks(args: argparse.Namespace) -> int:
    """Ranks of every job: torchrun's (one host), else --ranks (default 1); ValueError when it cannot be."""
    _, world, local = launched_rank()
    if world > 1 and world != local:
        raise ValueError(f"--isolate runs its jobs on this host; this launch spans {world // local} hosts")
    if world > 1 and args.ranks not in (None, world):
        raise ValueError(f"--ranks {args.ranks} differs from torchrun's {world} ranks; give one of the two")
    n = world if world > 1 else (args.ranks or 1)
    if n < 1:
        raise ValueError(f"--ranks must be >= 1, got {n}")
    return n


def job_command(nproc: int, argv: list[str], out: Path, folder: Path) -> list[str]:
    """The command of one job: this bench's arguments, the result folder fixed, the job's folder added."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return [*launcher, str(BENCH_SCRIPT), *argv, "--out", str(out), "--isolated-child", str(folder)]


def job_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}


@dataclass
class Job:
    """How one job ended, as this process saw it."""

    folder: Path
    seconds: float
    returncode: int
    timed_out: bool
    started: str | None  # the measurement it took (started.json), None when it took none
    result: dict[str, Any] | None  # its result.json, None when it ended before writing it
    error: str  # its failure in one line, "" when it ran to its end

    @property
    def status(self) -> str:
        if self.error:
            return "failed"
        return str((self.result or {}).get("status") or "ok").split(":")[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _error_of(folder: Path, returncode: int, timed_out: bool, limit_s: float, result: dict | None) -> str:
    """The job's failure in one line: its first `peerline: error:` line (the rank and the error), else a rank's
    noted line, else its exit; past its limit, that it did not finish (and its line, if a rank wrote one); "" when
    it ended well."""
    if not timed_out and returncode == 0 and result is not None:
        outcome = str(result.get("outcome", ""))
        return outcome if outcome.startswith("failed") else ""
    try:
        log = (folder / "log.txt").read_text(errors="replace").splitlines()
    except OSError:
        log = []
    line = next((m.group(1).strip() for m in map(_ERROR_LINE.search, log) if m), None)
    if line is None:
        line = next((f.read_text().strip() for f in sorted(folder.glob("failed-rank*.txt"))), None)
    if timed_out:
        return f"did not finish within {limit_s:g} s (its processes were ended)" + (f"; {line}" if line else "")
    if line:
        return line
    tail = next((ln.strip() for ln in reversed(log) if ln.strip()), "no output")
    return f"exit {returncode} without an error line; its last line: {tail[:300]}"


class Runner:
    """Starts the jobs one at a time, waits for each within its limit, prints the progress lines."""

    def __init__(self, nproc: int, argv: list[str], out: Path, limit_s: float, say: Callable[[str], None],
                 subreaper: bool = True) -> None:
        self.nproc, self.argv, self.out, self.limit_s, self.say = nproc, argv, out, limit_s, say
        self.t0 = time.monotonic()
        if subreaper:  # off in tests that run jobs inside the test process
            proc_tree.become_subreaper()

    def elapsed(self) -> str:
        return str(datetime.timedelta(seconds=round(time.monotonic() - self.t0)))

    def run(self, folder: Path, label: Callable[[str | None], str]) -> Job:
        """Run the job of `folder` (its ledger written); `label(measurement)` names it in the progress lines."""
        t0, before = time.monotonic(), set(proc_tree.descendants(os.getpid()))
        with (folder / "log.txt").open("w") as log:
            proc = subprocess.Popen(job_command(self.nproc, self.argv, self.out, folder), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=job_environment(),
                                    start_new_session=True)
            try:
                started, timed_out = self._wait(proc, folder, t0, label)
            except BaseException:  # interrupted (a signal, Ctrl-C): the job must not outlive this process
                proc_tree.end_tree(proc)
                raise
        left = proc_tree.end_leftovers(before)
        if left:
            self.say(f"{label(started)}: ended {left} process(es) its job left running")
        started = started or (_read_json(folder / STARTED) or {}).get("id")
        result = _read_json(folder / RESULT)
        error = _error_of(folder, proc.returncode, timed_out, self.limit_s, result)
        return Job(folder, time.monotonic() - t0, proc.returncode, timed_out, started, result, error)

    def _wait(self, proc: subprocess.Popen, folder: Path, t0: float, label: Callable[[str | None], str]
              ) -> tuple[str | None, bool]:
        """Wait for the job, announcing its measurement once it has taken one; end it past the limit."""
        started, last_line = None, t0
        while proc.poll() is None:
            now = time.monotonic()
            if started is None and (folder / STARTED).exists():
                started = (_read_json(folder / STARTED) or {}).get("id")
                self.say(f"{label(started)}: running (bench {self.elapsed()})")
                last_line = now
            if now - last_line >= PROGRESS_EVERY_S:
                self.say(f"{label(started)}: still running after {now - t0:.0f} s (bench {self.elapsed()})")
                last_line = now
            if now - t0 > self.limit_s:
                n = proc_tree.end_tree(proc)
                self.say(f"{label(started)}: ended after {self.limit_s:g} s ({n} processes)")
                return started, True
            time.sleep(POLL_S)
        return started, False


class SuiteJobs:
    """The jobs of one suite, until every measurement it reaches is done (see the module docstring)."""

    def __init__(self, name: str, runner: Runner, merged: MergedResults, stem: str) -> None:
        self.name, self.runner, self.merged, self.stem = name, runner, merged, stem
        self.mode = "measure" if name in PER_MEASUREMENT else "whole"
        self.done: list[str] = []
        self.measured: dict[str, Any] = {}
        self.known: list[str] = []  # every measurement the last complete job reached, in the suite's order
        self.failed: list[str] = []
        self.untaken_outcome: str | None = None  # the outcome line of a job that took no measurement

    def run(self) -> str:
        """Run the jobs; the suite's outcome line ("ok: ..." or "failed: ...")."""
        final: dict[str, Any] | None = None
        k = 0
        while True:
            k += 1
            job = self.runner.run(self._folder(k), self._label)
            if job.started is None or job.started in self.done:  # took none: the suite whole, or its report
                final = self._untaken(job)
                break
            self._taken(job)
            if job.result is not None and all(mid in self.done for mid in job.result.get("seen", [])):
                final = job.result
                break
        if final is not None:
            self.merged.add_final(final)
        self.merged.write(self.stem)
        return self._outcome()

    def _folder(self, k: int) -> Path:
        folder = self.runner.out / "isolated" / f"{self.name}-{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        ledger = {"suite": self.name, "mode": self.mode, "done": self.done, "measured": self.measured}
        (folder / LEDGER).write_text(json.dumps(ledger))
        return folder

    def _label(self, mid: str | None) -> str:
        if mid is None:
            return f"{self.name}" + (" (every result replayed)" if self.done else "")
        i = len(self.done) + (mid not in self.done)
        n = max(len(self.known), i) if self.known else "?"
        return f"{self.name} {i}/{n}: {mid.removeprefix(self.name + ' ')}"

    def _taken(self, job: Job) -> None:
        """A job that took one measurement: its result into the ledger, its failure noted."""
        mid = job.started
        assert mid is not None
        result = job.result or {}
        if job.result is not None:
            self.known = list(result.get("seen", self.known))
        label = self._label(mid)
        self.done.append(mid)
        if not job.error and result.get("measured") is not None:
            self.measured[mid] = result["measured"]
        self.merged.add_job(job.result)
        if job.error:
            self.failed.append(f"{mid}: {job.error}")
            self.merged.note(f"FAILED {mid}: {job.error} (its job was ended; the bench went on)")
        self._report(mid, label, job)

    def _untaken(self, job: Job) -> dict[str, Any] | None:
        """A job that took no measurement (a whole suite, or every result replayed): its result when complete."""
        self.untaken_outcome = (job.result or {}).get("outcome")
        if job.error:
            what = "suite" if self.mode == "whole" or not self.done else "report (every result replayed)"
            self.failed.append(job.error)
            self.merged.add_job(job.result)
            self.merged.note(f"FAILED {self.name} {what}: {job.error}")
        self._report(None, self._label(None), job)
        return None if job.error else job.result

    def _report(self, mid: str | None, label: str, job: Job) -> None:
        self.merged.outcome(self.name, mid, job.status, job.error, job.seconds, job.folder)
        self.merged.write(self.stem)
        tail = f": {job.error}" if job.error else ""
        self.runner.say(f"{label}: {job.status.upper() if job.error else job.status} in {job.seconds:.1f} s{tail} "
                        f"(bench {self.runner.elapsed()})")

    def _outcome(self) -> str:
        records = sum(1 for suite, _ in self.merged.records if suite == self.name)
        n = len(self.done)
        what = f"{n} measurement{'s' * (n != 1)} in their own jobs, " if self.mode == "measure" else ""
        if self.failed:
            return f"failed: {len(self.failed)} failed ({what}{records} records): {self.failed[0]}"
        if not self.done and self.untaken_outcome:  # the suite's own line: ok, skipped, not available
            return self.untaken_outcome
        return f"ok: {what}{records} records"


class Interrupted(Exception):
    """A signal that ends the bench: raised in the main thread, so the job running is ended before the exit."""


def _interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def run_isolated(names: list[str], args: argparse.Namespace, argv: list[str], say: Callable[[str], None]) -> int:
    """Every suite of `names` as jobs (see the module docstring); 0 when none failed, 1 when one did, 2 on a usage
    error. Under torchrun only rank 0 runs them; the other ranks return at once."""
    from peerline.bench import suites as registry
    from peerline.bench.cli import PROG, result_dir

    rank, _, _ = launched_rank()
    if rank != 0:
        return 0
    try:
        nproc = job_ranks(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    out = result_dir(args).absolute()
    merged = MergedResults(out, facts={"world_size": nproc, "isolated": True,
                                       "command": "python launch/bench.py " + " ".join(argv)})
    runner = Runner(nproc, argv, out, args.isolate_timeout_s, say)
    outcome: dict[str, str] = {}
    signal.signal(signal.SIGTERM, _interrupted)  # a launcher's or `timeout`'s end: the job running is ended first
    signal.signal(signal.SIGHUP, _interrupted)
    try:
        for name in names:
            why = registry.rank_reason(name, nproc)
            outcome[name] = f"skipped: {why}" if why else SuiteJobs(name, runner, merged, args.stem).run()
    except (Interrupted, KeyboardInterrupt) as exc:
        stopped = next((n for n in names if n not in outcome), names[-1])
        outcome[stopped] = f"failed: interrupted ({exc or 'SIGINT'}); its job was ended, the suites after it not run"
    for name, what in outcome.items():
        if not what.startswith("ok"):
            merged.note(f"suite {name}: {what}")
    paths = merged.write(args.stem)
    for name, what in outcome.items():
        say(f"{name}: {what}")
    if paths:
        say(f"wrote {paths[0]}, {paths[1]} and {out / 'measurements.jsonl'}")
    return 1 if any(v.startswith("failed") for v in outcome.values()) else 0
