"""Preemption on 2 ranks (pp=2, gloo): a signal to one rank or to torchrun stops every rank at one iteration
boundary, the checkpoint of that iteration is written, rank 0 says so in one line, every rank exits 75; resuming
gives the losses and final parameters of an uninterrupted run.

Rank 0 sleeps 3 s before iteration 3 (a delay fault, which changes no number): the signal is sent once iteration 2
is logged, so it always lands in that pause and the job stops after iteration 3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerline.distributed.resilience.preemption import EXIT_PREEMPTED
from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, run_command, torchrun_cmd, uninterrupted_run
from tests.ports import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MODEL = ["--hidden", "16", "--layers", "2", "--seq", "8", "--micro-batch-size", "2", "-m", "2", "--device", "cpu",
         "--iters", "6", "--timeout-s", "60"]
PAUSE = "delay:rank=0:iter=3:s=3"


def _ranks(n: int, args: list[str], cwd: Path) -> list[subprocess.Popen]:
    """n ranks of the main job as plain processes with torchrun's variables, so each can be signalled."""
    port = str(free_port())
    env = cpu_env(PEERLINE_FAULT=PAUSE)
    return [subprocess.Popen([sys.executable, PIPELINE, *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             env=dict(env, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                                      LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(n)]


def _signal_after_iteration_2(watched: subprocess.Popen, target: subprocess.Popen, sig: int) -> None:
    """Read the watched process's stdout until iteration 2 is logged, then send `sig` to the target."""
    for line in watched.stdout:
        if line.startswith("iter 2/"):
            target.send_signal(sig)
            return
    raise AssertionError("the job ended before iteration 2 was logged")


def _finish(procs: list[subprocess.Popen], limit_s: float = 120) -> list[tuple[int, str, str]]:
    t0, done = time.monotonic(), []
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
        done.append((p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted 6-iteration run."""
    return uninterrupted_run(tmp_path_factory.mktemp("reference"), MODEL)


def _resume_matches(tmp: Path, reference: dict) -> None:
    """The resume of the preempted job, its ranks forked (tests/forkjob.py): the checkpoint is the subject here, the
    signal's path through the launcher is each test's own."""
    p = run_command([*forkrun_cmd(2), PIPELINE, *MODEL, "--resume", "ck", "--json", "res.json"], tmp,
                    timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "peerline: resumed from ck at iteration 3" in p.stdout
    got = json.loads((tmp / "res.json").read_text())
    assert got["iterations"] == [4, 5, 6]
    assert got["losses"] == reference["losses"][3:], "the resumed run differs from the uninterrupted one"
    assert got["layer_checksums"] == reference["layer_checksums"]


def test_a_signal_to_one_rank_stops_every_rank_after_a_checkpoint(tmp_path, reference, sig=signal.SIGUSR1):
    procs = _ranks(2, [*MODEL, "--save", "ck"], tmp_path)
    try:
        _signal_after_iteration_2(procs[0], procs[1], sig)
        (rc0, out0, err0), (rc1, out1, err1) = _finish(procs)
    finally:
        for p in procs:
            p.kill()
    assert (rc0, rc1) == (EXIT_PREEMPTED, EXIT_PREEMPTED), err0 + err1
    name = signal.Signals(sig).name
    assert out0.splitlines()[-1] == (f"peerline: preempted by {name} on rank 1 after iteration 3: checkpoint of "
                                     f"iteration 3 in ck; continue with --resume ck; exit {EXIT_PREEMPTED}")
    assert "peerline: saved checkpoint of iteration 3 to ck" in out0
    assert "Traceback" not in err0 + err1 and "error" not in err0 + err1
    assert not (tmp_path / "ck" / ".peerline.lock").exists()
    _resume_matches(tmp_path, reference)


def test_a_signal_to_torchrun_stops_the_job_after_a_checkpoint(tmp_path, reference, sig=signal.SIGTERM):
    p = subprocess.Popen([*torchrun_cmd(2), PIPELINE, *MODEL, "--save", "ck"], cwd=tmp_path,
                         env=cpu_env(PEERLINE_FAULT=PAUSE), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        _signal_after_iteration_2(p, p, sig)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    name = signal.Signals(sig).name
    # torchrun forwards the signal to every worker and ends with its own exit code (1) and traceback
    assert f"peerline: preempted by {name} on rank " in out and " after iteration 3: checkpoint of iteration 3" \
        in out, out + err
    assert "peerline: error" not in err, err
    _resume_matches(tmp_path, reference)


def _worker_of(torchrun: subprocess.Popen, rank: int, limit_s: float = 60) -> int:
    """The pid of torchrun's worker process of `rank` (a child of torchrun with RANK=<rank> in its environment)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
        for pid in children:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under torchrun {torchrun.pid}")


def test_a_long_check_interval_still_stops_at_the_next_boundary(tmp_path, reference):
    """--preempt-check-every 1000 under torchrun, SIGUSR1 to one worker: the ranks agree on the logged iteration
    after the signal (not 1000 iterations later), save it and exit 75; the resume matches."""
    p = subprocess.Popen([*torchrun_cmd(2), PIPELINE, *MODEL, "--save", "ck", "--preempt-check-every", "1000"],
                         cwd=tmp_path, env=cpu_env(PEERLINE_FAULT=PAUSE), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        worker = _worker_of(p, 1)
        for line in p.stdout:
            if line.startswith("iter 2/"):
                os.kill(worker, signal.SIGUSR1)
                break
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert (f"peerline: preempted by SIGUSR1 on rank 1 after iteration 3: checkpoint of iteration 3 in ck; continue "
            f"with --resume ck; exit {EXIT_PREEMPTED}") in out, out + err
    assert "without reaching an iteration boundary" not in out + err, out + err
    assert "peerline: error" not in err, err
    _resume_matches(tmp_path, reference)


def test_a_long_check_interval_with_sparse_logs_is_said_at_start_up(tmp_path):
    p = run_command([sys.executable, PIPELINE, *MODEL, "--iters", "2", "--preempt-check-every", "1000",
                     "--log-every", "2"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert ("peerline: notice: --preempt-check-every 1000 with --log-every 2: a preemption signal stops the job at "
            "the next iteration that is a multiple of 2 or 1000, not at the next one") in p.stdout, p.stdout


def test_ctrl_c_to_torchrun_without_save_says_nothing_was_saved(tmp_path):
    p = subprocess.Popen([*torchrun_cmd(2), PIPELINE, *MODEL], cwd=tmp_path, env=cpu_env(PEERLINE_FAULT=PAUSE),
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _signal_after_iteration_2(p, p, signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("peerline: preempted")]
    assert len(lines) == 1 and lines[0].startswith("peerline: preempted by SIGINT on rank "), out + err
    assert lines[0].endswith(f" after iteration 3: nothing saved (no --save DIR); exit {EXIT_PREEMPTED}")
    assert "KeyboardInterrupt" not in err and "peerline: error" not in err, err
