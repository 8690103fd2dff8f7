"""Run under MPI: `mpirun -n 2 python -m pytest --with-mpi tests/integration`.

Every MPI process is one rank. The test builds the single-process reference in-process first (no process group
yet), then the distributed run over the ranks mpirun started (launcher detected from mpi4py), and compares
losses and parameters. On the CPU this is gloo; on the GPU machine the same tests run with NCCL.
"""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.config import RunConfig
from peerline.distributed.env import LaunchInfo, detect_launch
from peerline.distributed.runtime import Runtime
from tests.helpers import assert_same_run

TINY = dict(hidden=32, layers=4, seq=8, micro_batch_size=2, iters=3)
SINGLE = LaunchInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                    master_port=0, launcher="single")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _train(cfg: RunConfig, info: LaunchInfo | None) -> tuple[list[float], dict[str, list[float]]]:
    rt = Runtime.create(cfg, info)
    try:
        losses = rt.train()
        sums = rt.layer_checksums()
    finally:
        rt.close()
    return losses, sums


def _compare(losses, sums, ref_losses, ref_sums, rtol):
    assert_same_run({"losses": losses, "layer_checksums": sums},
                    {"losses": ref_losses, "layer_checksums": ref_sums}, rtol)


@pytest.fixture(scope="module")
def world():
    info = detect_launch()
    if info.world_size < 2:
        pytest.skip("needs mpirun -n 2 (or more) with --with-mpi")
    return info


# fp32 with TF32 off on GPUs; gloo on the CPU: the pipeline reorders no arithmetic inside a stage, and a dp
# average differs from the big batch's mean only in summation order: 1e-5 relative.
RTOL = 1e-5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_over_all_ranks_equals_single_process(world, schedule):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = 2 * world.world_size
    base = dict(TINY, device=_device(), dtype="fp32", schedule=schedule, microbatches=m, graph=False)
    ref = _train(RunConfig(**base, pp=1), SINGLE)
    got = _train(RunConfig(**base), world)
    _compare(*got, *ref, RTOL)


@pytest.mark.mpi(min_size=2)
def test_data_parallel_over_all_ranks_equals_single_process(world):
    torch.backends.cuda.matmul.allow_tf32 = False
    m = 2
    base = dict(TINY, device=_device(), dtype="fp32", graph=False)
    ref = _train(RunConfig(**base, microbatches=m * world.world_size), SINGLE)
    got = _train(RunConfig(**base, microbatches=m, dp=world.world_size), world)
    _compare(*got, *ref, RTOL)
