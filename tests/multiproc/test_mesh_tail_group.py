"""Mesh.create_groups with dp options (a CTA cap on NCCL) also makes an uncapped twin of each dp group, the tail
group GradBuckets all-reduces the last-finished buckets on; without options there is none. Checked with gloo on 4
processes (pp=2 x dp=2), every rank creating every group in the same order."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from peerline.distributed.mesh import Mesh
from tests.helpers import forkserver

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        plain = Mesh(pp=2, dp=2, rank=rank)
        plain.create_groups()
        capped = Mesh(pp=2, dp=2, rank=rank)
        capped.create_groups(dp_options=dist.ProcessGroupGloo._Options())
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=capped.dp_tail_group)  # ranks stage + {0, 2}: the dp group of this stage
        results[rank] = (plain.dp_tail_group is None, dist.get_world_size(capped.dp_tail_group), t.item())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_capped_dp_groups_get_an_uncapped_tail_twin() -> None:
    world = 4
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), results), nprocs=world, join=True,
                           start_method="forkserver")
        got = dict(results)
    # stage 0: ranks 0 and 2 (sum 2); stage 1: ranks 1 and 3 (sum 4)
    assert got == {0: (True, 2, 2.0), 1: (True, 2, 4.0), 2: (True, 2, 2.0), 3: (True, 2, 4.0)}
