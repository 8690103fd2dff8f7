"""Launch the GPU tests' subprocesses (launch/pipeline.py runs, torchrun workers, tools) with a time bound and a log
file each, and cache pipeline results for the session: a reference run shared by several tests runs once, and
one-rank runs asked for together run side by side, one GPU each. CPU-safe to import (torch only inside)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / "launch" / "pipeline.py"
WORKERS = Path(__file__).resolve().parent / "workers"


def cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as none
        return 0


def gpu_env(**extra: str) -> dict[str, str]:
    """The environment of a GPU subprocess: this one's, with the checkout importable, mpirun allowed as root, and
    no CPU or device forcing left over from the CPU tests. A non-empty CUDA_VISIBLE_DEVICES stays, so a test run on
    a pair of a larger machine keeps to its pair; an empty one (hidden by a CPU helper) goes."""
    env = {k: v for k, v in os.environ.items() if k != "PEERLINE_DEVICE"}
    if not env.get("CUDA_VISIBLE_DEVICES", "").strip():
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def fault_env(fault: str = "") -> dict[str, str]:
    """`gpu_env` of ranks spawned by hand (tests.multiproc.failures_util.spawn), with PEERLINE_FAULT set."""
    return gpu_env(PEERLINE_FAULT=fault)


def launcher(nproc: int) -> list[str]:
    """A plain process for one rank, torchrun (standalone rendezvous) for more."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def device_of(slot: int) -> str:
    """CUDA_VISIBLE_DEVICES for the slot-th GPU this process sees (respects a list already set)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[slot] if slot < len(visible) else str(slot)


@dataclass
class Job:
    """A started subprocess, its output going to `log`."""

    proc: subprocess.Popen
    log: Path
    timeout: float

    def wait(self) -> tuple[int | None, str]:
        """(exit status, None when it ran past its timeout and was killed with its children; the log's tail)."""
        try:
            rc: int | None = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: torchrun's ranks go too
            self.proc.wait()
            rc = None
        text = self.log.read_text(errors="replace")
        return rc, text[-6000:]


def start(cmd: Sequence[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> Job:
    """Start cmd in its own session (so a timeout can end all its processes), stdout and stderr into log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env or gpu_env(), start_new_session=True)
    return Job(proc, log, timeout)


def run(cmd: Sequence[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run cmd to the end or its timeout: (exit status or None, the log's tail)."""
    return start(cmd, log, timeout, env).wait()


def outcome(what: str, rc: int | None, tail: str, timeout: float) -> str:
    """How a subprocess ended, for an assertion message."""
    how = f"timed out after {timeout:g} s" if rc is None else f"exit status {rc}"
    return f"{what}: {how}; end of its log:\n{tail}"


@dataclass(frozen=True)
class Run:
    """One launch/pipeline.py job: its flags, its rank count, extra environment and time bound."""

    name: str
    args: tuple[str, ...]
    nproc: int = 1
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = 180.0

    @property
    def key(self) -> tuple:
        return self.args, self.nproc, self.env

    def command(self, json_path: Path) -> list[str]:
        return [*launcher(self.nproc), str(PIPELINE), *self.args, "--json", str(json_path)]


class RunCache:
    """Pipeline results by command line, each run at most once per session; a failed run fails every test that
    asks for it with the same message, without running again."""

    def __init__(self, out: Path, gpus: int) -> None:
        self.out, self.gpus = out, max(1, gpus)
        self._done: dict[tuple, dict | str] = {}

    def results(self, *runs: Run) -> list[dict]:
        """The results of runs, in order; those not run yet run now (one-rank ones side by side first)."""
        todo = list({r.key: r for r in runs if r.key not in self._done}.values())
        singles = [r for r in todo if r.nproc == 1]
        for i in range(0, len(singles), self.gpus):
            wave = singles[i:i + self.gpus]
            jobs = [self._start(r, {"CUDA_VISIBLE_DEVICES": device_of(slot)}) for slot, r in enumerate(wave)]
            for r, job in zip(wave, jobs):
                self._finish(r, job)
        for r in (r for r in todo if r.nproc > 1):
            self._finish(r, self._start(r, {}))
        found = [self._done[r.key] for r in runs]
        for res in found:
            if isinstance(res, str):
                pytest.fail(res, pytrace=False)
        return found  # type: ignore[return-value]

    def _start(self, r: Run, extra: dict[str, str]) -> Job:
        (self.out / f"{r.name}.json").unlink(missing_ok=True)
        env = gpu_env(**dict(r.env), **extra)
        return start(r.command(self.out / f"{r.name}.json"), self.out / f"{r.name}.log", r.timeout, env)

    def _finish(self, r: Run, job: Job) -> None:
        rc, tail = job.wait()
        path = self.out / f"{r.name}.json"
        if rc == 0 and path.exists():
            self._done[r.key] = json.loads(path.read_text())
        else:
            self._done[r.key] = outcome(f"run {r.name} ({' '.join(r.args)}, {r.nproc} rank(s))", rc, tail, r.timeout)
