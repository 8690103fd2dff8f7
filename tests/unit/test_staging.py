"""CPU tests of the pinned staging feed (distributed/memory/staging.py): the slot ring's recycling on a fake clock, the
data equal to DataFeed's, and a CPU Runtime trained through the feed equal to the DataFeed run."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.config import RunConfig
from peerline.distributed.memory.staging import HostSlotRing, PinnedStagingFeed, attach
from peerline.distributed.pipeline.engine import DataFeed

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class FakeFence:
    """A copy that finishes at `done_at` on the fake clock; synchronize() lets time pass until then."""

    def __init__(self, clock: Clock, done_at: float) -> None:
        self.clock, self.done_at = clock, done_at
        self.syncs = 0

    def query(self) -> bool:
        return self.clock.now >= self.done_at

    def synchronize(self) -> None:
        self.syncs += 1
        self.clock.now = max(self.clock.now, self.done_at)


def test_ring_reuses_a_slot_only_after_its_copy_finished():
    clock = Clock()
    ring = HostSlotRing(["a", "b", "c"])
    fences = []
    order = []
    # Each copy takes 1.0 time unit on a single copy engine, queued behind the previous one; the host needs 0.1
    # to fill a slot. With 3 slots the host must wait from the 4th slot on, each time for the oldest copy only.
    engine_free = 0.0
    for k in range(9):
        i, slot = ring.acquire()
        prev = fences[k - 3] if k >= 3 else None
        if prev is not None:
            assert prev.query(), f"slot {i} handed out at t={clock.now} before its copy ended at {prev.done_at}"
        order.append(slot)
        clock.now += 0.1  # host fill
        engine_free = max(engine_free, clock.now) + 1.0
        fence = FakeFence(clock, engine_free)
        fences.append(fence)
        ring.release(i, fence)
    assert order == ["a", "b", "c"] * 3
    assert ring.acquired == 9
    assert ring.waits == 6  # every acquire after the ring filled found its slot's copy still running
    assert [f.syncs for f in fences[:6]] == [1] * 6 and [f.syncs for f in fences[6:]] == [0] * 3


def test_ring_never_waits_when_copies_are_done_and_release_none_frees():
    clock = Clock()
    ring = HostSlotRing([0, 1])
    for _ in range(5):
        i, _ = ring.acquire()
        ring.release(i, FakeFence(clock, clock.now))  # already finished
        clock.now += 1
    i, _ = ring.acquire()
    ring.release(i, None)
    assert ring.waits == 0 and ring.in_flight() == 0


def test_ring_waits_for_its_own_slot_not_the_newest():
    clock = Clock()
    ring = HostSlotRing(["x", "y"])
    i0, _ = ring.acquire()
    f0 = FakeFence(clock, 5.0)
    ring.release(i0, f0)
    i1, _ = ring.acquire()
    f1 = FakeFence(clock, 50.0)
    ring.release(i1, f1)
    assert ring.in_flight() == 2
    i2, _ = ring.acquire()
    assert i2 == i0 and clock.now == 5.0 and f1.syncs == 0  # waited for slot x's copy only


def test_ring_rejects_no_slots():
    with pytest.raises(ValueError, match="at least one slot"):
        HostSlotRing([])


def _buffers(m: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.full(shape, float("nan")) for _ in range(m)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("replica", [0, 1])
def test_staging_feed_gives_exactly_datafeeds_data_on_cpu(overlap, replica):
    m, shape, seed = 3, (2, 5, 4), 1234
    ref = DataFeed(seed=seed, replica=replica, microbatches=m, inputs=_buffers(m, shape), targets=_buffers(m, shape),
                   generator=torch.Generator())
    feed = PinnedStagingFeed(seed=seed, replica=replica, microbatches=m, inputs=_buffers(m, shape),
                             targets=_buffers(m, shape), streams=None, slots=2, overlap=overlap)
    for it in (0, 1, 7):
        ref.load(it)
        feed.load(it)
        for a, b in zip(ref.inputs + ref.targets, feed.inputs + feed.targets):
            assert torch.isfinite(b).all() and torch.equal(a, b)
    assert not torch.equal(feed.inputs[0], feed.inputs[1])  # microbatches differ
    assert feed.in_ring.acquired == 3 * m


def test_staging_feed_without_refill_keeps_slot_contents():
    m, shape = 4, (3, 2)
    feed = PinnedStagingFeed(seed=0, replica=0, microbatches=m, inputs=_buffers(m, shape), targets=[],
                             streams=None, slots=2, refill=False, results="none")
    feed.load(0)
    first = [b.clone() for b in feed.inputs]
    feed.load(1)
    # Two slots round robin: microbatch k of any iteration reads slot k % 2, filled once (iteration 0, mb k % 2).
    assert torch.equal(feed.inputs[0], first[0]) and torch.equal(feed.inputs[2], first[0])
    assert torch.equal(feed.inputs[3], first[1])


@pytest.mark.parametrize("kwargs,message", [
    ({"results": "everything"}, "unknown results"),
    ({"slots": 0}, "must be >= 1"),
    ({"results": "outputs"}, "needs out_shape"),
])
def test_staging_feed_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PinnedStagingFeed(seed=0, replica=0, microbatches=2, inputs=_buffers(2, (2,)), targets=_buffers(2, (2,)),
                          streams=None, **kwargs)


def _train(stages: int, schedule: str, staged: bool, iters: int = 3, results: str = "outputs"):
    from peerline.distributed.runtime import Runtime

    cfg = RunConfig(hidden=16, layers=4, seq=4, micro_batch_size=2, microbatches=4, iters=iters, stages=stages,
                    schedule=schedule, device="cpu", seed=3)
    rt = Runtime.create(cfg)
    try:
        feed = attach(rt, results=results, keep_outputs=True) if staged else None
        losses = rt.train()
        sums = rt.layer_checksums()
        got = feed.drain() if feed is not None else []
    finally:
        rt.close()
    return losses, sums, got


@pytest.mark.parametrize("schedule,stages", [("gpipe", 4), ("1f1b", 2)])
def test_cpu_runtime_with_staging_feed_equals_datafeed_run(schedule, stages):
    ref_losses, ref_sums, _ = _train(1, schedule, staged=False)
    losses, sums, results = _train(stages, schedule, staged=True)
    assert losses == ref_losses, (stages, losses, ref_losses)
    assert sums == ref_sums
    # Per-microbatch losses came back for every iteration; their mean is the iteration's loss.
    assert [r.iteration for r in results] == [0, 1, 2]
    for r, loss in zip(results, losses):
        assert r.losses.shape == (4,) and torch.isfinite(r.losses).all()
        assert abs(float(r.losses.mean()) - loss) <= 1e-6 * abs(loss)
        assert r.outputs is not None and r.outputs.shape == (4, 2, 4, 16) and torch.isfinite(r.outputs).all()
    assert not torch.equal(results[0].outputs, results[1].outputs)


def test_second_attach_detaches_the_first_and_shares_its_result_buffers():
    from peerline.distributed.runtime import Runtime

    cfg = RunConfig(hidden=16, layers=2, seq=4, micro_batch_size=2, microbatches=2, iters=2, stages=2,
                    device="cpu", seed=1)
    rt = Runtime.create(cfg)
    try:
        first = attach(rt, results="outputs")
        rt.run_iteration()
        second = attach(rt, results="outputs", overlap=False)
        assert first.hook_handle is None and second.hook_handle is not None
        # A graph captured with the first feed's hook writes the first feed's buffers: the second reads those.
        assert second.loss_dev is first.loss_dev and second.out_dev is first.out_dev
        rt.run_iteration()
        got = second.drain()
        assert [r.iteration for r in got] == [1] and torch.isfinite(got[0].losses).all()
        assert first.tap_mb == 2  # the first hook saw iteration 0 only
    finally:
        rt.close()
