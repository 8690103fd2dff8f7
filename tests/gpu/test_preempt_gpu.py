"""Preemption on two GPUs with the GPU defaults: whole-iteration CUDA graphs and the copy engine. SIGUSR1 to rank 1
while rank 0 pauses before iteration 7 (a delay fault, no change to any number; graphs were captured at iteration 3):
both ranks stop after iteration 7, the checkpoint of iteration 7 is written, rank 0 prints the preempted line, both
exit 75; resuming gives the losses (1e-6) and parameters of the uninterrupted run. About 1.5 minutes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peerline.distributed.resilience.preemption import EXIT_PREEMPTED
from tests.helpers import PIPELINE
from tests.multiproc.failures_util import STARTUP_S, losses
from tests.ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2, pytest.mark.timeout(300)]

MODEL = ["--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "-m", "4", "--kernels", "torch",
         "--dtype", "fp32", "--p2p", "copy-engine", "--graph", "--warmup-iters", "2", "--iters", "10",
         "--timeout-s", "120"]


def _env(fault: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PEERLINE_DEVICE", "CUDA_VISIBLE_DEVICES")}
    return dict(env, PEERLINE_FAULT=fault, OMP_NUM_THREADS="1")


def _ranks(args: list[str], cwd: Path, fault: str = "") -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen([sys.executable, PIPELINE, *MODEL, *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             env=dict(_env(fault), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(2)]


def _run(args: list[str], cwd: Path) -> None:
    procs = _ranks(args, cwd)
    outs = [p.communicate(timeout=STARTUP_S + 90) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-2000:] for o in outs)


def test_preempted_with_graphs_and_copy_engine_resumes_equal(tmp_path):
    _run(["--json", "full.json"], tmp_path)
    procs = _ranks(["--save", "ck"], tmp_path, fault="delay:rank=0:iter=7:s=4")
    try:
        for line in procs[0].stdout:
            if line.startswith("iter 6/"):
                procs[1].send_signal(signal.SIGUSR1)
                break
        outs = [p.communicate(timeout=STARTUP_S + 90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errs = "\n".join(o[1][-2000:] for o in outs)
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED, EXIT_PREEMPTED], errs
    assert ("peerline: preempted by SIGUSR1 on rank 1 after iteration 7: checkpoint of iteration 7 in ck; "
            "continue with --resume ck") in outs[0][0], outs[0][0] + errs
    assert "Traceback" not in errs, errs
    _run(["--resume", "ck", "--json", "resumed.json"], tmp_path)
    full = losses(tmp_path / "full.json")
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["config"]["graph"] is True, "the resumed run did not replay a captured graph"
    assert resumed["iterations"] == [8, 9, 10]
    for got, want in zip(resumed["losses"], full[7:], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed["losses"], full[7:])
    ref = json.loads((tmp_path / "full.json").read_text())["layer_checksums"]
    for key, (s, sq) in resumed["layer_checksums"].items():
        assert abs(s - ref[key][0]) <= 1e-5 * max(1.0, abs(ref[key][0])) and abs(sq - ref[key][1]) <= 1e-5 * sq, key
