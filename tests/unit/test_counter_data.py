"""CPU checks of the counter-based synthetic data (distributed/data/counter.py, `--data counter`) and its feed."""

from __future__ import annotations

import math

import pytest
import torch

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.data import counter as counter_data
from peerline.distributed.pipeline.engine import CounterDataFeed

pytestmark = pytest.mark.timeout(60)


def test_the_gpu_kernel_source_is_found():
    # The GPU path compiles this file; on the CPU nothing else would notice a wrong path.
    assert counter_data.KERNEL_SOURCE.is_file(), counter_data.KERNEL_SOURCE
    assert "pl_counter_normal" in counter_data.KERNEL_SOURCE.read_text()


def test_mix64_matches_splitmix64s_published_first_output():
    # splitmix64 seeded with 0 returns mix64(0 + golden) first: 0xE220A8397B1DCDAF (Vigna's reference code).
    assert counter_data.mix64(counter_data.GOLDEN) == 0xE220A8397B1DCDAF


def _python_normal(seed: int, iteration: int, global_mb: int, stream: int, i: int) -> float:
    """The definition, in Python ints and float64 (the torch ops must agree to fp32 rounding)."""
    seed_mix, salt = counter_data.host_constants(seed, global_mb, stream)
    mask = counter_data.MASK64
    key = counter_data.mix64(counter_data.mix64(seed_mix ^ ((iteration * counter_data.GOLDEN) & mask)) ^ salt)
    h = counter_data.mix64((key + (i + 1) * counter_data.GOLDEN) & mask)
    u1 = ((h >> 40) + 0.5) * 2.0 ** -24
    u2 = (((h >> 16) & 0xFFFFFF) + 0.5) * 2.0 ** -24
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_reference_fill_follows_the_definition():
    out = torch.full((3, 5, 7), float("nan"))
    counter_data.reference_fill(out, 123, torch.tensor([41]), global_mb=5, stream=1)
    flat = out.flatten()
    for i in (0, 1, 2, 50, 104):
        want = _python_normal(123, 41, 5, 1, i)
        assert abs(flat[i].item() - want) <= 1e-5 * max(1.0, abs(want)), (i, flat[i].item(), want)
    assert torch.isfinite(out).all()


def test_counter_data_is_deterministic_distinct_and_standard_normal():
    def make(seed: int, it: int, mb: int, stream: int, n: int = 1 << 18) -> torch.Tensor:
        out = torch.empty(n)
        counter_data.fill(out, seed, torch.tensor([it]), mb, stream)
        return out

    a = make(1, 7, 0, 0)
    assert torch.equal(a, make(1, 7, 0, 0))
    for other in (make(2, 7, 0, 0), make(1, 8, 0, 0), make(1, 7, 1, 0), make(1, 7, 0, 1)):
        assert not torch.equal(a[:1000], other[:1000])
    assert abs(a.mean().item()) < 0.01 and abs(a.std().item() - 1.0) < 0.01
    assert abs(((a > 1.0).float().mean().item()) - 0.1587) < 0.005  # the normal's upper tail, not just its moments


def test_counter_feed_load_generate_advance():
    shape = (2, 3, 4)
    feed = CounterDataFeed(seed=5, replica=1, microbatches=2, inputs=[torch.empty(shape) for _ in range(2)],
                           targets=[torch.empty(shape) for _ in range(2)], generator=torch.Generator(),
                           counter=torch.zeros(1, dtype=torch.int64))
    feed.load(3)
    first = [b.clone() for b in feed.inputs + feed.targets]
    want = torch.empty(shape)
    counter_data.reference_fill(want, 5, torch.tensor([3]), global_mb=1 * 2 + 1, stream=1)
    assert torch.equal(feed.targets[1], want)  # replica 1's microbatch 1 is global microbatch 3
    feed.advance()  # what a captured iteration does after generating: the next replay makes iteration 4
    feed.generate()
    after = [b.clone() for b in feed.inputs + feed.targets]
    feed.counter_at = None
    feed.load(4)
    assert all(torch.equal(x, y) for x, y in zip(after, feed.inputs + feed.targets))
    assert not torch.equal(first[0], after[0])
    with pytest.raises(NotImplementedError):
        feed.load_into(0, feed.inputs, feed.targets)


def test_counter_data_needs_direct_staging():
    with pytest.raises(ConfigError, match="--staging direct"):
        RunConfig(data="counter", staging="pinned")
    with pytest.raises(ConfigError, match="--graph-loop needs --data seeded or counter"):
        RunConfig(data="files", graph_loop=2)  # any other --data is token data: a path or a user feed


def test_cpu_run_with_counter_data_trains_and_repeats():
    from peerline.distributed.runtime import Runtime

    def train() -> list[float]:
        cfg = RunConfig(hidden=16, layers=2, seq=4, micro_batch_size=2, microbatches=2, iters=4, device="cpu",
                        seed=4, data="counter")
        rt = Runtime.create(cfg)
        try:
            return rt.train()
        finally:
            rt.close()

    losses = train()
    assert losses == train() and len(set(losses)) == 4 and all(math.isfinite(x) for x in losses)
