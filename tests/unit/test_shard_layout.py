"""The shard arithmetic of --shard-optimizer (grad_sync/sharded.py) and its configuration checks."""

from __future__ import annotations

import random

import pytest
import torch

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.grad_sync.buckets import ALIGN_BYTES, plan_buckets
from peerline.distributed.grad_sync.sharded import pad_for_shards, shard_range


def _params(sizes: list[int], dtypes: list[torch.dtype]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in zip(sizes, dtypes, strict=True)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_padded_buckets_split_into_equal_aligned_shards_and_tile_each_buffer(dp):
    rng = random.Random(dp)
    sizes = [rng.randint(1, 5000) for _ in range(40)]
    dtypes = [rng.choice([torch.float32, torch.bfloat16]) for _ in sizes]
    buckets = plan_buckets(_params(sizes, dtypes), bucket_mb=0.01, first_bucket_mb=0.002)
    unpadded = [b.numel for b in buckets]
    shards = pad_for_shards(buckets, dp)
    ends: dict[torch.dtype, int] = {}
    for b, before, shard in zip(buckets, unpadded, shards, strict=True):
        itemsize = torch.empty((), dtype=b.dtype).element_size()
        step = ALIGN_BYTES // itemsize
        assert b.numel == shard * dp and shard % step == 0  # equal shards, each starting aligned
        assert before <= b.numel < before + step * dp  # the least padding that does it
        assert b.offset == ends.get(b.dtype, 0)  # each dtype's buckets end to end, in index order
        ends[b.dtype] = b.offset + b.numel
        assert b.starts[-1] + b.params[-1].numel() <= before  # the parameters stay where they were
        starts = [shard_range(b.numel, dp, r) for r in range(dp)]
        assert starts[0][0] == 0 and starts[-1][1] == b.numel
        assert all(a[1] == c[0] and a[1] - a[0] == shard for a, c in zip(starts, starts[1:]))


def test_shard_range_refuses_unequal_shards():
    assert shard_range(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError):
        shard_range(10, 3, 0)
    with pytest.raises(ValueError):
        shard_range(12, 3, 3)


@pytest.mark.parametrize("extra,message", [({"grad_sync": "per-param"}, "needs --grad-sync buckets"),
                                           ({"model": "gpt", "tie_embeddings": True}, "--tie-embeddings")])
def test_shard_optimizer_refuses_what_it_cannot_shard(extra, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(shard_optimizer=True, dp=2, **extra)
    RunConfig(dp=2, **extra)  # the same without --shard-optimizer is fine
