"""--save-async on GPUs (NCCL for training, the writer's own gloo group, CUDA graphs, page-locked staging): the
background checkpoints hold what synchronous ones hold (every tensor within 1e-6, fp32) and a resume from each ends
with the losses and parameters of the other (1e-5), on one GPU (pp=1) and two (pp=2); with a slow write injected
(slow-save: 8 s on rank 1), training goes on: the progress lines of the iterations after the save point come
before the line that says the checkpoint is complete, which verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.jobs import REPO, gpu_env, launcher, outcome, run
from tests.helpers import worst_difference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

MODEL = ["--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "4", "-m", "4", "--dtype", "fp32",
         "--warmup-iters", "1", "--timeout-s", "120"]
PIPELINE = str(REPO / "launch" / "pipeline.py")


def _job(out: Path, nproc: int, args: list[str], name: str, **env: str) -> tuple[dict, str]:
    """The job's --json record and its whole log (stdout and stderr of every rank)."""
    cmd = [*launcher(nproc), PIPELINE, *MODEL, *args, "--json", str(out / f"{name}.json")]
    rc, tail = run(cmd, out / f"{name}.log", 300, gpu_env(**env))
    assert rc == 0, outcome(name, rc, tail, 300)
    log = (out / f"{name}.log").read_text()
    assert "cudaHostRegister failed" not in log  # the staging buffers were page-locked
    return json.loads((out / f"{name}.json").read_text()), log


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from peerline.distributed.resilience import dcp_io

    specs = dcp_io.tensor_specs(dcp_io.read_metadata(folder))
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items()}
    dcp_io.load(state, folder)
    return state


def _same_as_sync(gpu_out: Path, nproc: int) -> None:
    out = gpu_out / f"async_pp{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    ends = {}
    for mode, flags in (("sync", []), ("async", ["--save-async"])):
        ck = str(out / mode)
        _job(out, nproc, ["--iters", "4", "--save", ck, "--save-every", "2", *flags], f"{mode}-first")
        ends[mode], _ = _job(out, nproc, ["--iters", "8", "--save", ck, "--resume", ck, *flags], f"{mode}-end")
    for it in (2, 8):
        want, got = (_tensors(out / m / f"iter_{it:06d}") for m in ("sync", "async"))
        assert sorted(want) == sorted(got)
        for key in (k for k in want if ".python" not in k and ".numpy" not in k):
            assert torch.allclose(want[key].double(), got[key].double(), rtol=1e-6, atol=0), (it, key)
    assert ends["async"]["iterations"] == [5, 6, 7, 8]
    worst, where = worst_difference(ends["async"], ends["sync"])
    assert worst <= 1e-5, (worst, where)


def test_async_equals_sync_one_gpu(gpu_out: Path) -> None:
    _same_as_sync(gpu_out, 1)


@pytest.mark.gpu2
def test_async_equals_sync_two_gpus(gpu_out: Path) -> None:
    _same_as_sync(gpu_out, 2)


@pytest.mark.gpu2
def test_training_goes_on_while_the_write_is_slow_two_gpus(gpu_out: Path) -> None:
    from peerline.distributed.resilience import checkpoint_store as store

    out = gpu_out / "async_slow"
    out.mkdir(parents=True, exist_ok=True)
    _, log = _job(out, 2, ["--iters", "8", "--save", str(out / "ck"), "--save-every", "4", "--save-async"], "slow",
                  PEERLINE_FAULT="slow-save:rank=1:iter=4:s=8")
    lines = log.splitlines()

    def at(prefix: str) -> int:
        return next(i for i, ln in enumerate(lines) if ln.startswith(prefix))

    assert at("iter 5/8") < at("iter 6/8") < at("iter 7/8") < at("peerline: saved checkpoint of iteration 4")
    for it in (4, 8):
        assert all(store.verify(out / "ck", it, r, {}, world=2) is None for r in range(2))
