"""Bucketed all-reduce across 2 CPU ranks (gloo): torchrun and mpirun launch buckets_worker.py, which compares
the bucketed gradients with a per-parameter all-reduce (bitwise) and a single-process reference."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("buckets_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} hung for {exc.timeout} s:\n{exc.stdout}\n{exc.stderr}")


def _check(proc: subprocess.CompletedProcess) -> None:
    # Two processes share one stdout: their lines can interleave, so find each rank's report by pattern.
    ok = re.findall(r"rank \d+ OK \d+ cases", proc.stdout)
    assert proc.returncode == 0 and len(ok) == 2, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_buckets_torchrun_gloo() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _check(_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(WORKER)], env))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_buckets_mpirun_gloo() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed")
    import socket

    with socket.socket() as s:  # a free port for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    _check(_run([mpirun, "-n", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS",
                 sys.executable, str(WORKER)], env))
