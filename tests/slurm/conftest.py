"""A real single-node Slurm for the batch-script tests: installed if missing, started once per session, and
always stopped by PID at the end.

Skipped (with the reason) when Slurm cannot be had here: not root, no apt-get, install failed. With
PEERLINE_REQUIRE_SLURM=1 (CI) those are failures instead.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed, skip_or_fail  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: submits batch scripts to a real single-node Slurm (root + apt)")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on this machine, configured under a temporary folder."""
    if os.geteuid() != 0:
        skip_or_fail("a private Slurm needs root (slurmd starts jobs as their user)")
    try:
        ensure_installed(timeout_s=240)
    except SlurmUnavailable as exc:
        skip_or_fail(str(exc))
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    # Backstop for an interpreter exit that skips fixture finalization; stop() is idempotent.
    atexit.register(cluster.stop)
    try:
        try:
            cluster.start()
        except SlurmUnavailable as exc:
            pytest.fail(f"Slurm is installed but did not start: {exc}", pytrace=False)
        yield cluster
    finally:
        cluster.stop()
