"""--save-async on 2 ranks (pp=2, gloo, forked ranks): the background checkpoints hold exactly what synchronous ones
hold and resume to the same losses and parameters; training goes on while a write is slow; a crash while a write
is in flight leaves no checkpoint of it, and resume takes the previous one; a failed background write ends the
job with one line.

Slow and failing writes are injected with PEERLINE_FAULT (slow-save, fail-save: inside the rank's write, once its
files are written). Ordering, not timing, is asserted: a slow write holds its checkpoint for 6 s, and the progress
lines of the iterations after the save point come before the line that says the checkpoint is complete."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience import dcp_io
from peerline.distributed.resilience.preemption import EXIT_PREEMPTED
from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, run_command, uninterrupted_run
from tests.ports import free_port

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MODEL = ["--hidden", "16", "--layers", "2", "--seq", "8", "--micro-batch-size", "2", "-m", "2", "--device", "cpu",
         "--timeout-s", "60"]


def _job(tmp: Path, args: list[str], name: str, fault: str = "") -> tuple[object, dict | None]:
    env = cpu_env(PEERLINE_FAULT=fault) if fault else cpu_env()
    p = run_command([*forkrun_cmd(2), PIPELINE, *MODEL, *args, "--json", f"{name}.json"], tmp, env, timeout=240)
    out = tmp / f"{name}.json"
    return p, (json.loads(out.read_text()) if out.exists() else None)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, read back with DCP on this (undistributed) process."""
    specs = dcp_io.tensor_specs(dcp_io.read_metadata(folder))
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items()}
    dcp_io.load(state, folder)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted 8-iteration run, without checkpoints."""
    return uninterrupted_run(tmp_path_factory.mktemp("reference"), [*MODEL, "--iters", "8"])


def test_async_checkpoints_equal_sync_ones_and_resume_alike(tmp_path, reference):
    resumed = {}
    for mode, flags in (("sync", []), ("async", ["--save-async"])):
        p, _ = _job(tmp_path, ["--iters", "4", "--save", mode, "--save-every", "2", "--keep", "2", *flags],
                    f"{mode}-first")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        saved = [ln for ln in p.stdout.splitlines() if "saved checkpoint" in ln]
        assert saved == [f"peerline: saved checkpoint of iteration {n} to {mode}" for n in (2, 4)]
        p, resumed[mode] = _job(tmp_path, ["--iters", "8", "--save", mode, "--resume", mode, *flags], f"{mode}-end")
        assert p.returncode == 0 and "peerline: resumed from " + mode + " at iteration 4" in p.stdout, p.stderr
    for it in (2, 8):
        want, got = (_tensors(ckpt.iteration_dir(tmp_path / m, it)) for m in ("sync", "async"))
        assert sorted(want) == sorted(got) and any(k.startswith("optim.") for k in got)
        for key in want:
            if ".python" not in key and ".numpy" not in key:  # Python's and NumPy's are unseeded, run to run
                assert torch.equal(want[key], got[key]), (it, key)
    assert store.iterations(tmp_path / "async") == [8, 4, 2] and not list((tmp_path / "async").glob(".*.tmp"))
    assert resumed["async"]["losses"] == resumed["sync"]["losses"] == reference["losses"][4:]
    assert resumed["async"]["layer_checksums"] == resumed["sync"]["layer_checksums"] == reference["layer_checksums"]


def test_training_goes_on_while_the_write_is_slow(tmp_path):
    p, rec = _job(tmp_path, ["--iters", "6", "--save", "ck", "--save-every", "3", "--save-async"], "slow",
                  fault="slow-save:rank=1:iter=3:s=6")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "fault injected: rank 1's write of checkpoint 3 sleeps 6 s" in p.stderr
    lines = p.stdout.splitlines()

    def at(prefix: str) -> int:
        return next(i for i, ln in enumerate(lines) if ln.startswith(prefix))

    # The write of checkpoint 3 was still in flight while iterations 4 and 5 ran and were logged.
    assert at("iter 3/6") < at("iter 4/6") < at("iter 5/6") < at("peerline: saved checkpoint of iteration 3 to ck")
    assert at("peerline: saved checkpoint of iteration 3") < at("peerline: saved checkpoint of iteration 6")
    assert rec["iterations"] == [1, 2, 3, 4, 5, 6]
    for it in (3, 6):
        assert store.verify(tmp_path / "ck", it, 0, {}, world=2) is None
        assert store.verify(tmp_path / "ck", it, 1, {}, world=2) is None


def test_a_crash_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, reference):
    # Rank 1's write of checkpoint 4 is held for 60 s; rank 0 dies before iteration 6, the write still in flight.
    p, _ = _job(tmp_path, ["--iters", "8", "--save", "ck", "--save-every", "2", "--save-async"], "crash",
                fault="slow-save:rank=1:iter=4:s=60;kill:rank=0:iter=6")
    assert p.returncode != 0 and "killed before iteration 6" in p.stderr, p.stderr[-3000:]
    ck = tmp_path / "ck"
    assert store.iterations(ck) == [2] and ckpt.latest_iteration(ck) == 2
    assert (ck / ".iter_000004.tmp").is_dir()  # the half-written checkpoint, never renamed into place
    p, rec = _job(tmp_path, ["--iters", "8", "--save", "ck", "--resume", "ck", "--save-every", "2", "--save-async"],
                  "resumed")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "peerline: resumed from ck at iteration 2" in p.stdout
    assert rec["iterations"] == [3, 4, 5, 6, 7, 8]
    assert rec["losses"] == reference["losses"][2:]
    assert rec["layer_checksums"] == reference["layer_checksums"]
    assert not (ck / ".iter_000004.tmp").exists() and store.iterations(ck) == [8, 6, 4, 2]


def test_a_failed_background_write_ends_the_run_in_one_line(tmp_path):
    p, rec = _job(tmp_path, ["--iters", "6", "--save", "ck", "--save-every", "2", "--save-async"], "failed",
                  fault="fail-save:rank=1:iter=2")
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
    assert p.returncode == 2 and errors == [
        "peerline: error: cannot write checkpoint ck/iter_000002 of iteration 2: [Errno 5] fault injected: rank 1's "
        "write of checkpoint 2 fails (rank 1)"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and rec is None
    assert "iter 5/6" not in p.stdout  # stopped at the next boundary, or at the save point after it at the latest
    assert store.iterations(tmp_path / "ck") == []


def test_a_preemption_waits_for_the_write_in_flight(tmp_path):
    """Real processes (a signal to one rank): the write of checkpoint 2 is held 10 s on rank 1; rank 0 pauses 3 s
    before iteration 3, where the signal lands; every rank stops after iteration 3, waits for checkpoint 2, then
    writes checkpoint 3."""
    port = str(free_port())
    env = cpu_env(PEERLINE_FAULT="delay:rank=0:iter=3:s=3;slow-save:rank=1:iter=2:s=10")
    args = [*MODEL, "--iters", "6", "--save", "ck", "--save-every", "2", "--save-async"]
    procs = [subprocess.Popen([sys.executable, PIPELINE, *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("iter 2/"):
                procs[1].send_signal(signal.SIGUSR1)
                break
        (out0, err0), (out1, err1) = (p.communicate(timeout=180) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED] * 2, err0[-2000:] + err1[-2000:]
    lines = out0.splitlines()
    saved = [ln for ln in lines if "saved checkpoint" in ln]
    assert saved == [f"peerline: saved checkpoint of iteration {n} to ck" for n in (2, 3)], out0
    assert lines[-1].startswith("peerline: preempted by SIGUSR1 on rank 1 after iteration 3: checkpoint of "
                                "iteration 3 in ck"), out0
    assert "Traceback" not in err0 + err1 and "peerline: error" not in err0 + err1
    for it in (2, 3):
        assert all(store.verify(tmp_path / "ck", it, r, {}, world=2) is None for r in range(2))
    assert not (tmp_path / "ck" / ".peerline.lock").exists()
