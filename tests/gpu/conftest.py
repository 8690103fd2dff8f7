"""GPU tests: tests marked gpu / gpu2 / gpu4 skip, with the reason, where fewer CUDA devices than they need are
present; the session's output folder ($PEERLINE_GPU_OUT, else a temporary one) and its pipeline-run cache; each
failure's text written to $PEERLINE_GPU_OUT/failures.txt as it happens, so a run cut by its time limit (before
pytest's own summary) still shows why a test failed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.jobs import RunCache, cuda_devices

NEEDS = (("gpu4", 4), ("gpu2", 2), ("gpu", 1))
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = None
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        need = next((n for marker, n in NEEDS if item.get_closest_marker(marker)), 0)
        if not need:
            continue
        have = cuda_devices() if have is None else have
        if have < need:
            reason = "needs CUDA" if need == 1 else f"needs {need} CUDA devices"
            item.add_marker(pytest.mark.skip(reason=f"{reason} (found {have})"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    env = os.environ.get("PEERLINE_GPU_OUT")
    if env and report.failed:
        Path(env).mkdir(parents=True, exist_ok=True)
        with open(Path(env) / "failures.txt", "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n")


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where runs keep their logs and results: $PEERLINE_GPU_OUT (set by tools/gpu_checks.sh, packed into its
    logs.tgz), else a temporary folder."""
    env = os.environ.get("PEERLINE_GPU_OUT")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    return tmp_path_factory.mktemp("gpu-out")


@pytest.fixture(scope="session")
def pipeline_runs(gpu_out: Path) -> RunCache:
    """launch/pipeline.py results shared by the session's tests (references run once)."""
    return RunCache(gpu_out / "runs", cuda_devices())
