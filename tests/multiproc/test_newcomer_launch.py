"""A newcomer's launches for real: under torchrun an error is one line, once, last, with exit code 2 (the error file
and peerline's torchrun plugin); --print-schedule shows the grid the launch would train, once; mpirun without
mpi4py refuses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PIPELINE, cpu_env, mpirun_cmd, torchrun_cmd


def _launch(launcher: list[str], args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, PIPELINE, *args], capture_output=True, text=True, timeout=180,
                          env=cpu_env(**env), cwd=tmp_path)


def _errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("peerline: error:")]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--microbatches", "0"], "peerline: error: --microbatches must be >= 1, got 0"),
    (["--schedule", "zigzag"], "peerline: error: argument --schedule: invalid choice: 'zigzag'"),
])
def test_torchrun_error_is_the_last_line_and_the_exit_code(tmp_path, args, message):
    """The line once, last on stderr, exit code 2: peerline's torchrun plugin (peerline/torchrun_report.py) in place of
    torchrun's ChildFailedError traceback and exit 1."""
    proc = _launch(torchrun_cmd(2), args, tmp_path)
    assert [ln[:len(message)] for ln in _errors(proc.stderr)] == [message], proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(message), proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_torchrun_print_schedule_shows_the_trained_grid_once(tmp_path):
    proc = _launch(torchrun_cmd(2), ["--print-schedule", "-m", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("schedule 1f1b: 2 stage(s) (pp=2") == 1, proc.stdout
    assert proc.stdout.count(" step | stage 0") == 1 and "| stage 1" in proc.stdout
    assert proc.stdout.count("legend:") == 1


@pytest.mark.slow
def test_mpirun_without_mpi4py_refuses_once(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    hidden = tmp_path / "hide" / "mpi4py"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('mpi4py hidden by the test')\n")
    proc = _launch(mpirun_cmd(2), ["--iters", "2"], tmp_path, PYTHONPATH=str(hidden.parent))
    assert proc.returncode != 0
    errors = _errors(proc.stdout + proc.stderr)
    assert errors == ["peerline: error: mpirun started 2 processes but mpi4py is not installed, so each would "
                      "train alone; pip install mpi4py (or pip install 'peerline[mpi]')"], proc.stdout + proc.stderr
    assert "final loss" not in proc.stdout

