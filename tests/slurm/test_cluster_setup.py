"""The Slurm fixture's decisions without Slurm: when it installs, skips or fails (fast, no daemons)."""

from __future__ import annotations

import pytest
import slurm_cluster
from slurm_cluster import SlurmUnavailable, ensure_installed, skip_or_fail


def test_nothing_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_cluster, "missing_executables", lambda: [])
    monkeypatch.setattr(slurm_cluster.subprocess, "run", lambda *a, **k: pytest.fail("ran a command"))
    ensure_installed()


def test_not_root_cannot_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_cluster, "missing_executables", lambda: ["slurmd"])
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match="slurmd missing.*not root"):
        ensure_installed()


def test_no_apt_cannot_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_cluster, "missing_executables", lambda: ["sbatch"])
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name, path=None: None)
    with pytest.raises(SlurmUnavailable, match="apt-get is unavailable"):
        ensure_installed()


def test_skip_or_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEERLINE_REQUIRE_SLURM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no slurm here"):
        skip_or_fail("no slurm here")
    monkeypatch.setenv("PEERLINE_REQUIRE_SLURM", "1")
    with pytest.raises(pytest.fail.Exception, match="PEERLINE_REQUIRE_SLURM=1 but no slurm here"):
        skip_or_fail("no slurm here")
