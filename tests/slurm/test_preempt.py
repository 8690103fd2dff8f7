"""Preemption through the real Slurm: slurm/pipeline.sbatch (CPU form, 2 ranks under torchrun) gets SIGUSR1 on its
batch shell, as `#SBATCH --signal=B:USR1@120` sends it before the time limit (here `scancel --batch
--signal=USR1`). The ranks stop at one iteration boundary after a checkpoint, the job requeues itself, and the
requeued run resumes (--resume) to the losses and parameters of an uninterrupted run.

Rank 0 sleeps 5 s before iteration 3 (a delay fault, which changes no number): the signal is sent once iteration 2
is in the log, so the job always stops after iteration 3; the requeued run starts at iteration 4 and never
pauses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import forkrun_cmd, run_command  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(480), pytest.mark.xdist_group("single-node")]

REPO = Path(os.environ.get("PEERLINE_REPO") or Path(__file__).resolve().parents[2]).resolve()
SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
MODEL = ["--seq", "8", "--hidden", "16", "--layers", "2", "--micro-batch-size", "2", "-m", "2", "--iters", "6",
         "--seed", "5", "--dtype", "fp32"]
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPUS", "TASKS",
          "PEERLINE_RESOLVE_ONLY", "PEERLINE_HEAD_ADDR", "PEERLINE_DEVICE", "PEERLINE_PYTHON", "PEERLINE_FAULT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _start_reference(tmp_path: Path) -> Future:
    """The uninterrupted run on 2 ranks, forked from the test fork server (tests/forkjob.py: torchrun's variables)
    beside the Slurm job (most of which is waiting: the pause, the requeue); `_reference` collects it."""
    cmd = [*forkrun_cmd(2), str(REPO / "launch" / "pipeline.py"), "--device", "cpu", *MODEL, "--json",
           str(tmp_path / "ref.json")]
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(run_command, cmd, tmp_path, _env(), 480)
    finally:
        pool.shutdown(wait=False)


def _reference(run: Future, tmp_path: Path) -> dict:
    proc = run.result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "ref.json").read_text())


def _wait_for(what: str, ready, timeout_s: float, describe) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{describe()}")


def _state(cluster: SlurmCluster, job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=cluster.env(), capture_output=True,
                         text=True, timeout=10)
    return out.stdout.strip()


def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_losses(slurm_cluster, tmp_path):
    reference_run = _start_reference(tmp_path)
    ck, res = tmp_path / "ck", tmp_path / "res.json"
    cmd = ["sbatch", "--parsable", f"--output={tmp_path}/%x_%j.out", "--time=5", "--gpus-per-node=0",
           "--cpus-per-task=2", str(SLURM_DIR / "pipeline.sbatch"), *MODEL, "--save", str(ck), "--resume", str(ck),
           "--json", str(res)]
    env = _env(PEERLINE_DEVICE="cpu", PEERLINE_PYTHON=sys.executable, PEERLINE_FAULT="delay:rank=0:iter=3:s=5")
    sub = subprocess.run(cmd, env=slurm_cluster.env(env), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().split(";")[0]
    log = tmp_path / f"peerline-pipeline_{job}.out"

    def text() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    def describe() -> str:
        return f"--- job log ---\n{text()}\n--- daemons ---\n{slurm_cluster.daemon_logs()[-3000:]}"

    _wait_for("iteration 2 in the log", lambda: "iter 2/6" in text(), 150, describe)
    sig = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_cluster.env(), capture_output=True,
                         text=True, timeout=30)
    assert sig.returncode == 0, sig.stdout + sig.stderr
    # Slurm holds a requeued job back for its credential lifetime (AuthInfo cred_expire, 120 s): start it now
    _wait_for("the job to be requeued", lambda: "requeued, it continues" in text()
              and _state(slurm_cluster, job) == "PENDING", 120, describe)
    # slurmd revokes the first run's credential at the requeue, to the second: a run started within that second
    # gets a credential that counts as revoked ("Killing non-startable batch job: Job credential revoked").
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm_cluster.env(), timeout=30,
                   check=True, capture_output=True)
    # the requeued run writes the --json record at its end; the job then leaves the queue
    _wait_for("the requeued run to finish", lambda: res.exists() and _state(slurm_cluster, job) == "", 240,
              describe)
    log_text = text()
    assert "got SIGUSR1: the ranks checkpoint and stop" in log_text, describe()
    assert "peerline: preempted by SIGUSR1 on rank " in log_text, describe()
    assert " after iteration 3: checkpoint of iteration 3 in " in log_text, describe()
    assert re.search(r"preempted \(exit code \d+\): requeued", log_text), describe()  # torchrun's own code
    assert f"peerline: resumed from {ck} at iteration 3" in log_text, describe()
    reference = _reference(reference_run, tmp_path)
    got = json.loads(res.read_text())
    assert got["iterations"] == [4, 5, 6], describe()
    assert got["losses"] == reference["losses"][3:], "the requeued run differs from the uninterrupted one"
    assert got["layer_checksums"] == reference["layer_checksums"]
