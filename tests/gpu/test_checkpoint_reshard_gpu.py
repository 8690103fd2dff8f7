"""Checkpoints reshard across grids on GPUs (NCCL, CUDA graphs, fused capturable AdamW): a run saved on one grid
resumes on another and ends with the losses and every layer's parameters of the uninterrupted run within 1e-5.
Two GPUs: pp=2 -> pp=1 and pp=1 -> pp=2; dp=2 with --shard-optimizer -> pp=1 unsharded. Four GPUs: pp=2 x dp=2
sharded -> pp=2 x dp=1 on two of them and back, pp=2 -> pp=4, pp=2 x dp=2 sharded -> pp=4, pp=4 -> dp=4 sharded.
fp32 (--dtype fp32) so the bound is the CPU tests' one."""

from __future__ import annotations

import json

import pytest

from tests.gpu.jobs import REPO, gpu_env, launcher, outcome, run
from tests.helpers import worst_difference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

MODEL = ["--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "4", "--dtype", "fp32",
         "--warmup-iters", "1", "--timeout-s", "120"]
PIPELINE = str(REPO / "launch" / "pipeline.py")
#: grid name -> (ranks, flags); the global batch is 4 microbatches everywhere
GRIDS = {"pp1": (1, ["-m", "4"]), "pp2": (2, ["-m", "4"]), "dp2s": (2, ["--dp", "2", "-m", "2", "--shard-optimizer"]),
         "pp2dp2s": (4, ["--pp", "2", "--dp", "2", "-m", "2", "--shard-optimizer"]), "pp4": (4, ["-m", "4"]),
         "dp4s": (4, ["--dp", "4", "-m", "1", "--shard-optimizer"])}


def _job(out, grid: str, args: list[str], name: str) -> dict:
    nproc, flags = GRIDS[grid]
    cmd = [*launcher(nproc), PIPELINE, *MODEL, *flags, *args, "--json", str(out / f"{name}.json")]
    rc, tail = run(cmd, out / f"{name}.log", 300, gpu_env())
    assert rc == 0, outcome(f"{grid} {name}", rc, tail, 300)
    return json.loads((out / f"{name}.json").read_text())


def _check(gpu_out, tag: str, saved: str, resumed: str, reference_grid: str) -> None:
    out = gpu_out / f"reshard_{tag}"
    out.mkdir(parents=True, exist_ok=True)
    ref = _job(out, reference_grid, ["--iters", "6"], "ref")
    _job(out, saved, ["--iters", "3", "--save", str(out / "ck")], "first")
    got = _job(out, resumed, ["--iters", "6", "--resume", str(out / "ck")], "second")
    assert got["iterations"] == [4, 5, 6]
    worst, where = worst_difference(got, {"losses": ref["losses"][3:], "layer_checksums": ref["layer_checksums"]})
    assert worst <= 1e-5, (worst, where)


@pytest.mark.gpu2
@pytest.mark.parametrize("saved, resumed", [("pp2", "pp1"), ("pp1", "pp2"), ("dp2s", "pp1")])
def test_reshard_two_gpus(gpu_out, saved: str, resumed: str) -> None:
    _check(gpu_out, f"{saved}_{resumed}", saved, resumed, "pp2")


@pytest.mark.gpu4
@pytest.mark.parametrize("saved, resumed", [("pp2dp2s", "pp2"), ("pp2", "pp2dp2s"), ("pp2", "pp4"), ("pp2dp2s", "pp4"),
                                            ("pp4", "dp4s")])
def test_reshard_four_gpus(gpu_out, saved: str, resumed: str) -> None:
    _check(gpu_out, f"{saved}_{resumed}", saved, resumed, "pp2")
