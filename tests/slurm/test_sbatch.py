"""slurm/*.sbatch submitted to a real single-node Slurm in their CPU form (2 ranks, gloo), checked against the
single-process run of the same model: same per-iteration losses; a grid that does not fit fails the job with the
harness's one-line error.

Every good job uses M*dp = 4 microbatches per iteration, so one single-process run (--pp 1 --dp 1, 4
microbatches) is the reference for all of them (replica r's microbatch m is global microbatch r*M+m).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import JobResult, SlurmCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import run_command  # noqa: E402

# Bounds the whole test including the session fixture's install + start-up on the first test (apt is slow).
# One xdist worker runs the single-node tests (one cluster, started once), the other the multinode ones (.ci/run).
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420), pytest.mark.xdist_group("single-node")]

# PEERLINE_REPO points the tests (and the scripts) at another checkout; by default this one.
REPO = Path(os.environ.get("PEERLINE_REPO") or Path(__file__).resolve().parents[2]).resolve()
SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
# A small model: the point is the launch path, not the arithmetic.
MODEL = ["--seq", "16", "--hidden", "32", "--layers", "4", "--micro-batch-size", "2", "--iters", "3",
         "--seed", "11", "--dtype", "fp32"]
TOTAL_MICROBATCHES = 4
# Launcher variables of an outer run (pytest under torchrun or inside a Slurm job) must not reach the jobs.
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPUS", "TASKS",
          "PEERLINE_RESOLVE_ONLY", "PEERLINE_HEAD_ADDR", "PEERLINE_DEVICE", "PEERLINE_PYTHON", "OMP_NUM_THREADS")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))}
    env.update(extra)
    return env


def _job_env(**extra: str) -> dict[str, str]:
    """The CPU form: PEERLINE_DEVICE=cpu, and the python running these tests (it has peerline installed)."""
    return _clean_env(**{"PEERLINE_DEVICE": "cpu", "PEERLINE_PYTHON": sys.executable, **extra})


def _submit(cluster: SlurmCluster, script: str, options: list[str], args: list[str], tmp_path: Path,
            **env: str) -> JobResult:
    # cwd = the checkout: the scripts find it through SLURM_SUBMIT_DIR, as a user's submission would.
    # --time=5 (minutes): a hung job is ended by Slurm itself, well before the 240 s we wait for sbatch.
    return cluster.sbatch(SLURM_DIR / script, args, options=["--time=5", *options], env=_job_env(**env), cwd=REPO,
                          log_dir=tmp_path, timeout_s=240)


def _losses(path: Path, result: JobResult) -> dict:
    assert path.exists(), f"the job wrote no --json file {path}\n{result.describe()}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-iteration losses of the single-process run (--pp 1 --dp 1, M*dp microbatches), forked from the test fork
    server (tests/forkjob.py): the reference is not what these tests are about."""
    out = tmp_path_factory.mktemp("reference") / "ref.json"
    cmd = [sys.executable, str(REPO / "launch" / "pipeline.py"), "--device", "cpu", "--pp", "1", "--dp", "1",
           "--microbatches", str(TOTAL_MICROBATCHES), *MODEL, "--json", str(out)]
    proc = run_command(cmd, out.parent, _clean_env(OMP_NUM_THREADS="1"), timeout=180)
    assert proc.returncode == 0, f"reference run failed: {cmd}\n{proc.stdout}\n{proc.stderr}"
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 3 and all(x == x for x in losses), losses  # 3 iterations, no NaN
    return losses


def _grid_line(log: str) -> str:
    found = [line for line in log.splitlines() if line.startswith("peerline-slurm: job=") and " world=" in line]
    assert found, "the job log does not start with the resolved grid"
    return found[0]


def _final_line(log: str) -> str:
    found = [line for line in log.splitlines() if line.startswith("peerline: final loss=")]
    assert len(found) == 1, f"expected one final line from rank 0, found {found}"
    return found[0]


# script, sbatch options of its CPU form on this 2-CPU node, grid flags, extra job environment, launcher seen
GOOD_JOBS = {
    "pipeline": ("pipeline.sbatch", ["--gpus-per-node=0", "--cpus-per-task=2"],
                 ["--pp", "2", "--dp", "1", "--microbatches", "4", "--schedule", "1f1b"], {}, "torchrun"),
    # Two torchrun agents (srun tasks) on the one node, one rank each: a real two-agent c10d rendezvous.
    "multinode": ("multinode.sbatch", ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
                  ["--pp", "1", "--dp", "2", "--microbatches", "2", "--schedule", "gpipe"], {"GPUS": "1"},
                  "torchrun"),
    # Keyed "srun", not "mpi": pytest-mpi skips every test with "mpi" among its keywords unless --with-mpi.
    "srun": ("mpi.sbatch", ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"],
            ["--pp", "2", "--dp", "1", "--microbatches", "4", "--schedule", "gpipe"], {}, "slurm"),
}


@pytest.mark.parametrize("name", list(GOOD_JOBS))
def test_job_matches_single_process(name: str, slurm_cluster: SlurmCluster, reference: list[float],
                                    tmp_path: Path) -> None:
    script, options, grid, env, launcher = GOOD_JOBS[name]
    out = tmp_path / "job.json"
    result = _submit(slurm_cluster, script, options, [*grid, *MODEL, "--json", str(out)], tmp_path, **env)
    assert result.returncode == 0, result.describe()
    # The scripts' own job names; the tests only moved the %x_%j.out log into tmp_path.
    job_name = f"peerline-{Path(script).stem}"
    assert result.log_path is not None and result.log_path.name == f"{job_name}_{result.job_id}.out"
    assert " world=2 " in _grid_line(result.log), result.describe()
    report = _losses(out, result)
    assert report["world_size"] == 2 and report["launcher"] == launcher, (report["launcher"], result.describe())
    assert report["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-7), result.describe()
    assert _final_line(result.log) == f"peerline: final loss={report['losses'][-1]:.9g} iterations=3"


@pytest.mark.parametrize("name", ["pipeline", "srun"])
def test_bad_grid_fails_with_one_line(name: str, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """--pp 3 on 2 ranks: the job exits non-zero and its log carries the harness's one-line error."""
    script, options, _, env, _ = GOOD_JOBS[name]
    result = _submit(slurm_cluster, script, options, ["--pp", "3", "--dp", "1", *MODEL], tmp_path, **env)
    assert result.returncode != 0, result.describe()
    errors = [line for line in result.log.splitlines() if line.startswith("peerline: error: ")]
    assert errors, f"no `peerline: error:` line in the job log\n{result.describe()}"
    assert all(re.search(r"\b3\b", line) and re.search(r"\b2\b", line) for line in errors), errors
    assert "peerline: final loss=" not in result.log


def test_bad_device_fails_before_srun(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The scripts' own checks fail the same way: one line, exit code 2, nothing started."""
    script, options, grid, _, _ = GOOD_JOBS["pipeline"]
    result = _submit(slurm_cluster, script, options, grid, tmp_path, PEERLINE_DEVICE="gpu")
    assert result.returncode == 2, result.describe()
    assert result.log.strip() == "peerline: error: PEERLINE_DEVICE=gpu: expected cpu, cuda or auto", result.describe()


def test_multinode_resolves_head_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """multinode.sbatch's address part alone (PEERLINE_RESOLVE_ONLY=1) on one node with two tasks: the head is
    the first host of `scontrol show hostnames`, its address an IPv4 literal, the port the harness's."""
    from peerline.distributed.env import slurm_port

    script, options, grid, env, _ = GOOD_JOBS["multinode"]
    result = _submit(slurm_cluster, script, options, grid, tmp_path, PEERLINE_RESOLVE_ONLY="1", **env)
    assert result.returncode == 0, result.describe()
    line = _grid_line(result.log)
    match = re.search(r" head=(\S+) addr=(\S+):(\d+)$", line)
    assert match, line
    head, addr, port = match.groups()
    assert head == slurm_cluster.node_name, line
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", addr), line
    assert int(port) == slurm_port(str(result.job_id)), line
    assert "nodes=1 " in line and " world=2 " in line, line  # 2 agents x GPUS=1


def test_scripts_parse() -> None:
    """`bash -n` on every script (needs no Slurm)."""
    scripts = sorted(SLURM_DIR.glob("*.sbatch")) + sorted(SLURM_DIR.glob("*.sh"))
    assert len(scripts) >= 4, scripts
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
