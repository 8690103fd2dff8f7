"""The slot-ring handoff protocol (distributed/p2p/handoff_protocol.py) against a simulated sender/receiver pair.

The op sequences checked here are the ones the copy-engine transport issues on the GPU.
"""

from __future__ import annotations

import pytest

from peerline.distributed.p2p import handoff_protocol as sr

pytestmark = pytest.mark.timeout(60)


def _run(depth: int, mbs: list[int], hold: int, seed: int, **kw) -> sr.Outcome:
    return sr.PairModel(depth, mbs, sr.fifo_plan(mbs, hold), seed=seed, **kw).run()


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_every_message_arrives_intact_with_a_slow_receiver(depth: int) -> None:
    mbs = list(range(12)) * 2  # two iterations: every slot is reused several times
    for seed in range(40):
        hold = 1 + seed % depth  # any in-flight count the ring covers
        out = _run(depth, mbs, hold, seed, receiver_weight=0.15, spin=3)
        assert out.ok, (seed, out.violations[:3], out.deadlock)
        assert out.delivered == mbs
        # Every slot is back in its initial state, so a captured graph can replay the same sequence.
        assert out.final_flags == {sr.FULL: [0] * depth, sr.FREE: [1] * depth}


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_fast_receiver_and_slow_sender(depth: int) -> None:
    mbs = list(range(10))
    for seed in range(20):
        out = sr.PairModel(depth, mbs, sr.fifo_plan(mbs, depth), seed=seed, receiver_weight=8.0).run()
        assert out.ok and out.delivered == mbs


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_schedule_needing_more_slots_than_the_ring_deadlocks(depth: int) -> None:
    mbs = list(range(8))
    out = _run(depth, mbs, hold=depth + 1, seed=1)
    assert out.deadlock and not out.violations
    # The same schedule fits a ring one slot deeper.
    assert _run(depth + 1, mbs, hold=depth + 1, seed=1).ok


def test_gpipe_holds_every_microbatch_and_needs_depth_m() -> None:
    m = 6
    mbs = list(range(m))
    assert _run(m, mbs, hold=m, seed=3, receiver_weight=0.3).ok
    assert _run(m - 1, mbs, hold=m, seed=3).deadlock


def test_out_of_order_release_into_a_busy_slot_blocks() -> None:
    # depth 2: mb 0 held while mb 2 (same slot) must arrive -> blocked although only two messages are held.
    plan = [("recv", 0), ("recv", 1), ("release", 1), ("recv", 2), ("release", 0), ("release", 2)]
    assert sr.PairModel(2, [0, 1, 2], plan, seed=0).run().deadlock


def _without_free_wait(slot: int) -> tuple[sr.Op, ...]:
    return tuple(op for op in sr.send_ops(slot) if op.action != "wait")


def _full_before_copy(slot: int) -> tuple[sr.Op, ...]:
    wait, take, copy, full = sr.send_ops(slot)
    return (wait, take, full, copy)


def _release_at_receive(slot: int) -> tuple[sr.Op, ...]:
    return sr.recv_ops(slot) + sr.release_ops(slot)


@pytest.mark.parametrize("broken", [
    sr.Protocol(send=_without_free_wait),
    sr.Protocol(send=_full_before_copy),
    sr.Protocol(recv=_release_at_receive, release=lambda slot: ()),
], ids=["no-free-wait", "full-before-copy", "early-release"])
def test_model_catches_broken_protocols(broken: sr.Protocol) -> None:
    """The checks can fail: each broken variant overwrites or reads early in some interleaving."""
    mbs = list(range(12))
    caught = 0
    for seed in range(60):
        out = sr.PairModel(2, mbs, sr.fifo_plan(mbs, 2), protocol=broken, seed=seed, receiver_weight=0.2,
                           spin=2).run()
        caught += bool(out.violations)
    assert caught > 0


def test_flag_words_live_with_their_owner() -> None:
    """FULL is written locally only by the receiver, FREE locally only by the sender."""
    for op in sr.send_ops(0):
        if op.action == "write":
            assert (op.flag == sr.FREE) == (op.where == sr.LOCAL)
    for op in sr.recv_ops(0) + sr.release_ops(0):
        assert (op.flag == sr.FULL) == (op.where == sr.LOCAL)
    for op in sr.send_ops(0) + sr.recv_ops(0):
        if op.action == "wait":
            assert op.where == sr.LOCAL  # every wait polls local memory, never across the link


def test_values_are_static() -> None:
    values = {op.value for s in range(4) for op in sr.send_ops(s) + sr.recv_ops(s) + sr.release_ops(s)}
    assert values <= {0, 1}
    assert [sr.slot_of(mb, 3) for mb in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        sr.PairModel(0, [0], [("recv", 0)])
    with pytest.raises(ValueError):
        sr.PairModel(1, [0], [("eat", 0)])
