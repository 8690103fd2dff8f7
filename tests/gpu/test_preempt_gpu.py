"""Preemption on two GPUs with the GPU defaults: whole-iteration CUDA graphs and the copy engine. SIGUSR1 to rank 1
while rank 0 pauses before iteration 7 (a delay fault, no change to any number; graphs were captured at iteration 3):
both ranks stop after iteration 7, the checkpoint of iteration 7 is written, rank 0 prints the preempted line, both
exit 75; resuming gives the losses (1e-6) and parameters of the uninterrupted run. On four GPUs the same at pp=2 x dp=2
with the signal sent to rank 3 (the last stage of the second replica), which the line names. About 1.5 minutes each."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peerline.distributed.resilience.preemption import EXIT_PREEMPTED
from tests.gpu.jobs import fault_env
from tests.helpers import PIPELINE
from tests.multiproc.failures_util import STARTUP_S, losses
from tests.ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
#: grid -> (ranks, extra flags, the rank SIGUSR1 is sent to)
GRIDS = {"pp2": pytest.param(2, [], 1, marks=pytest.mark.gpu2, id="pp2"),
         "pp2dp2": pytest.param(4, ["--pp", "2", "--dp", "2"], 3, marks=pytest.mark.gpu4, id="pp2dp2")}

MODEL = ["--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "-m", "4", "--kernels", "torch",
         "--dtype", "fp32", "--p2p", "copy-engine", "--graph", "--warmup-iters", "2", "--iters", "10",
         "--timeout-s", "120"]




def _ranks(world: int, args: list[str], cwd: Path, fault: str = "") -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen([sys.executable, PIPELINE, *MODEL, *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             env=dict(fault_env(fault), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(world)]


def _run(world: int, args: list[str], cwd: Path) -> None:
    procs = _ranks(world, args, cwd)
    outs = [p.communicate(timeout=STARTUP_S + 90) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1][-2000:] for o in outs)


@pytest.mark.parametrize("world, grid, signalled", list(GRIDS.values()))
def test_preempted_with_graphs_and_copy_engine_resumes_equal(tmp_path, world: int, grid: list[str], signalled: int):
    _run(world, [*grid, "--json", "full.json"], tmp_path)
    procs = _ranks(world, [*grid, "--save", "ck"], tmp_path, fault="delay:rank=0:iter=7:s=4")
    try:
        for line in procs[0].stdout:
            if line.startswith("iter 6/"):
                procs[signalled].send_signal(signal.SIGUSR1)
                break
        outs = [p.communicate(timeout=STARTUP_S + 90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errs = "\n".join(o[1][-2000:] for o in outs)
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED] * world, errs
    assert (f"peerline: preempted by SIGUSR1 on rank {signalled} after iteration 7: checkpoint of iteration 7 in ck; "
            "continue with --resume ck") in outs[0][0], outs[0][0] + errs
    assert "Traceback" not in errs, errs
    _run(world, [*grid, "--resume", "ck", "--json", "resumed.json"], tmp_path)
    full = losses(tmp_path / "full.json")
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["config"]["graph"] is True, "the resumed run did not replay a captured graph"
    assert resumed["iterations"] == [8, 9, 10]
    for got, want in zip(resumed["losses"], full[7:], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed["losses"], full[7:])
    ref = json.loads((tmp_path / "full.json").read_text())["layer_checksums"]
    for key, (s, sq) in resumed["layer_checksums"].items():
        assert abs(s - ref[key][0]) <= 1e-5 * max(1.0, abs(ref[key][0])) and abs(sq - ref[key][1]) <= 1e-5 * sq, key
