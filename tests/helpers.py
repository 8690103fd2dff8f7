"""Run the main job in subprocesses (torchrun, mpirun, plain python) and read its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIPELINE = str(REPO / "launch" / "pipeline.py")
TINY = ["--hidden", "32", "--layers", "4", "--seq", "8", "--micro-batch-size", "2", "--iters", "3"]


def cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env.update(extra)
    return env


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def mpirun_cmd(nproc: int) -> list[str]:
    return ["mpirun", "-n", str(nproc), "--oversubscribe", sys.executable]


def run_job(launcher: list[str], args: list[str], tmp_path: Path, name: str, timeout: float = 240,
            env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([*launcher, PIPELINE, *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env or cpu_env(), cwd=tmp_path)
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def assert_same_run(result: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Per-iteration losses and every layer's parameter checksums within rtol of the reference; every replica's
    layers equal replica 0's."""
    assert len(result["losses"]) == len(reference["losses"])
    for got, want in zip(result["losses"], reference["losses"]):
        assert abs(got - want) <= rtol * abs(want), (result["losses"], reference["losses"])
    ref_sums = {k.split("/")[1]: v for k, v in reference["layer_checksums"].items()}
    assert ref_sums
    for key, (s, sq) in result["layer_checksums"].items():
        want_s, want_sq = ref_sums[key.split("/")[1]]
        assert abs(s - want_s) <= rtol * max(1.0, abs(want_s)), (key, s, want_s)
        assert abs(sq - want_sq) <= rtol * abs(want_sq), (key, sq, want_sq)
    assert {k.split("/")[1] for k in result["layer_checksums"]} == set(ref_sums)
