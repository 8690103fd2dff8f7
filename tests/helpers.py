"""Run the main job in subprocesses (torchrun, mpirun, plain python) and read its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import forkjob
from tests.forkjob import PIPELINE, REPO  # noqa: F401 - REPO: the checkout, for the tests that import it here

TINY = ["--hidden", "32", "--layers", "4", "--seq", "8", "--micro-batch-size", "2", "--iters", "3"]


def cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env.update(extra)
    return env


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def forkrun_cmd(nproc: int) -> list[str]:
    """The job torchrun would start, its ranks forked from a process that imported torch and peerline once
    (tests/forkjob.py): for tests whose subject is the job, not the launcher."""
    return [sys.executable, forkjob.SCRIPT, f"--nproc_per_node={nproc}"]


def forkserver(preload: tuple[str, ...] = ("torch", "torch.distributed")):
    """multiprocessing's forkserver context, with OMP_NUM_THREADS=1 and torch imported once in its server: the
    processes a test starts with it (torch.multiprocessing.start_processes(..., start_method="forkserver"), its
    Manager) are forks of that server, not fresh interpreters importing torch each (seconds of CPU apiece).
    The first call in a process starts the server; later preloads are ignored."""
    import multiprocessing

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def run_command(cmd: list[str], cwd: str | os.PathLike, env: dict[str, str] | None = None,
                timeout: float = 240) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True): the main job or the bench, alone or under forkrun_cmd,
    runs as a fork of the test session's fork server (PEERLINE_TEST_FORKSERVER=0: as a real process), anything
    else as given."""
    env = env or cpu_env()
    if forkjob.split_command(cmd) and forkjob.enabled():
        return forkjob.ForkServer.shared().run(cmd, cwd, env, timeout)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def mpirun_cmd(nproc: int) -> list[str]:
    return ["mpirun", "-n", str(nproc), "--oversubscribe", sys.executable]


def run_job(launcher: list[str], args: list[str], tmp_path: Path, name: str, timeout: float = 240,
            env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / f"{name}.json"
    proc = run_command([*launcher, PIPELINE, *args, "--json", str(out)], tmp_path, env, timeout)
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def worst_difference(result: dict, reference: dict) -> tuple[float, str]:
    """Largest relative difference between two runs' per-iteration losses and per-layer parameter checksums
    ({"losses": [...], "layer_checksums": {"r<replica>/<layer>": [sum, sum of squares]}}), and where it is.
    Every replica's layers are compared with the reference's same layer. Shared by the CPU tests, the MPI
    integration tests and tests/gpu/compare_runs.py."""
    worst, where = 0.0, "nothing compared"
    for i, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        diff = abs(got - want) / abs(want)
        if diff >= worst:
            worst, where = diff, f"loss of iteration {i + 1}: {got} vs {want}"
    ref_sums = {k.split("/")[1]: v for k, v in reference["layer_checksums"].items()}
    for key, (s, sq) in result["layer_checksums"].items():
        want_s, want_sq = ref_sums[key.split("/")[1]]
        for diff, what in ((abs(s - want_s) / max(1.0, abs(want_s)), f"sum {s} vs {want_s}"),
                           (abs(sq - want_sq) / abs(want_sq), f"sum of squares {sq} vs {want_sq}")):
            if diff >= worst:
                worst, where = diff, f"layer {key}: {what}"
    return worst, where


def comparison_line(result: dict, reference: dict, worst: float, where: str, rtol: float) -> str:
    """The detail the GPU comparison scripts (tests/gpu/compare_runs.py, grids_compare.py) print for one run against
    its reference: the worst difference and where, both loss curves, the run's graph state and transport."""
    return (f"worst relative difference {worst:.3g} at {where} (bound {rtol:g}); "
            f"losses {[f'{v:.6f}' for v in result.get('losses', [])]} vs "
            f"{[f'{v:.6f}' for v in reference.get('losses', [])]}; "
            f"graph={result.get('graph')} transport={result.get('transport')}")


def assert_same_run(result: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Per-iteration losses and every layer's parameter checksums within rtol of the reference; every replica's
    layers equal replica 0's."""
    assert len(result["losses"]) == len(reference["losses"])
    ref_layers = {k.split("/")[1] for k in reference["layer_checksums"]}
    assert ref_layers
    assert {k.split("/")[1] for k in result["layer_checksums"]} == ref_layers
    worst, where = worst_difference(result, reference)
    assert worst <= rtol, (worst, where, result["losses"], reference["losses"])


def uninterrupted_run(tmp: Path, args: list[str], nproc: int = 2) -> dict:
    """The --json record of `args` run once on the CPU, start to end (a resume test's reference)."""
    p = run_command([*forkrun_cmd(nproc), PIPELINE, *args, "--json", "ref.json"], tmp, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((tmp / "ref.json").read_text())
