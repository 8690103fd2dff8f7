"""`torchrun --max-restarts 1` with --save/--resume of one directory, in the launch forms users type: --master_port
(static rendezvous) and --rdzv-endpoint (c10d). Rank 1 dies before iteration 3; the restarted attempt resumes from
the checkpoint of iteration 2 and ends with the losses and parameters of an uninterrupted run.

pp=1 x dp=2: the data-parallel group is a second process group, whose store keys a restarted attempt used to read
from the dead attempt (torchrun keeps its store across attempts): the restart hung or failed in `Gloo
connectFullMesh ... Connection refused` until env.attempt_store prefixed the keys with the attempt."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import PIPELINE, cpu_env, torchrun_cmd, uninterrupted_run
from tests.ports import free_port

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MODEL = ["--hidden", "16", "--layers", "2", "--seq", "8", "--micro-batch-size", "2", "-m", "2", "--device", "cpu",
         "--dp", "2", "--iters", "5", "--timeout-s", "60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return uninterrupted_run(tmp_path_factory.mktemp("reference"), MODEL)


@pytest.mark.parametrize("form", ["master_port", "rdzv_endpoint"])
def test_restart_resumes_and_matches_an_uninterrupted_run(tmp_path, reference, form):
    port = free_port()
    launch = ["--master_port", str(port)] if form == "master_port" else [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd = [*torchrun_cmd(2)[:-2], "--nproc_per_node=2", "--max-restarts=1", *launch, PIPELINE, *MODEL, "--save",
           "ck", "--save-every", "2", "--resume", "ck", "--json", "restart.json"]
    p = subprocess.run(cmd, cwd=tmp_path, env=cpu_env(PEERLINE_FAULT="kill:rank=1:iter=3"), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "killed before iteration 3" in p.stderr
    assert "connectFullMesh" not in p.stderr
    assert "peerline: resumed from ck at iteration 2" in p.stdout
    got = json.loads((tmp_path / "restart.json").read_text())
    assert got["iterations"] == [3, 4, 5]
    assert got["losses"] == reference["losses"][2:]
    assert got["layer_checksums"] == reference["layer_checksums"]
