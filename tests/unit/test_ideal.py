"""The ideal time of a pipelined iteration: the bubble bound and the schedule simulation."""

import dataclasses
import math

import pytest

from peerline.bench import ideal
from peerline.distributed.observe.timeline import Span

pytestmark = pytest.mark.timeout(30)


def test_bound_is_m_plus_p_minus_one_slowest_slots():
    assert ideal.bubble_bound_ms(8, [1.0, 1.5], [2.0, 2.5]) == pytest.approx(9 * 4.0)
    assert ideal.bubble_bound_ms(1, [3.0], [4.0]) == pytest.approx(7.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m,p", [(1, 1), (4, 2), (8, 4), (3, 5)])
def test_balanced_simulation_reaches_the_bound(schedule, m, p):
    # With equal stages and free transfers, GPipe and 1F1B both take exactly (M + P - 1)(f + b).
    f, b = 1.0, 2.0
    assert ideal.simulate_ms(schedule, m, [f] * p, [b] * p) == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("schedule", [s for s in ideal.SCHEDULES if s not in ideal.PLACED])
def test_uneven_stages_simulate_below_the_bound(schedule):
    fwd, bwd = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0]
    sim = ideal.simulate_ms(schedule, 6, fwd, bwd)
    bound = ideal.bubble_bound_ms(6, fwd, bwd)
    assert sim <= bound + 1e-9
    # The slow stage alone must run all its work: a lower bound any schedule respects.
    assert sim >= 6 * 9.0


def test_hand_computed_gpipe_two_stages():
    # Stage 0: F0 0-1, F1 1-2; stage 1: F0 1-3, F1 3-5, B0 5-9, B1 9-13; stage 0: B0 9-11, B1 13-15.
    assert ideal.simulate_ms("gpipe", 2, [1.0, 2.0], [2.0, 4.0]) == pytest.approx(15.0)


@pytest.mark.parametrize("m,p", [(4, 2), (8, 4), (6, 3)])
def test_zero_bubble_h1_takes_a_third_of_the_bubble(m, p):
    """B and W half the backward each (f = 1, b = 2): (P - 1)(f + b/2 - b/2) idle instead of (P - 1)(f + b)."""
    assert ideal.simulate_ms("zb-h1", m, [1.0] * p, [2.0] * p) == pytest.approx(3 * m + (p - 1))


def test_stages_per_rank_of_the_bench_variants():
    assert [ideal.stages_per_rank(s) for s in ("1f1b", "zb-h1", "interleaved", "zbv")] == [1, 1, 2, 2]
    # zb-interleaved: the most of 4, 3 stages per rank that split the layers evenly, else 2
    assert [ideal.stages_per_rank("zb-interleaved", pp, layers) for pp, layers in
            [(2, 16), (4, 16), (4, 24), (2, 24), (4, 8), (2, 10)]] == [4, 4, 3, 4, 2, 2]


def test_stage_orders_hold_every_action_once():
    for schedule in [s for s in ideal.SCHEDULES if s not in ideal.PLACED]:
        split = schedule == "zb-h1"
        for s in range(4):
            order = ideal.stage_order(schedule, s, 4, 6)
            want = [(op, i) for op in ("FBW" if split else "FB") for i in range(6)]
            assert sorted(order) == sorted(want)
    assert ideal.stage_order("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]


@pytest.mark.parametrize("schedule", ideal.PLACED)
def test_placed_schedules_hold_every_action_once_and_beat_1f1b(schedule):
    """Interleaved, ZB-V and interleaved zero bubble over 2 ranks of 2 stages: every (op, stage, mb) once on the
    stage's rank; with the stages' work halved (two per rank) they idle less than 1F1B, and the slowest rank's work
    bounds them below."""
    orders = ideal.rank_orders(schedule, 4, 4)
    ops = "FBW" if schedule in ideal.SPLIT else "FB"
    want = sorted((op, s, mb) for op in ops for s in range(4) for mb in range(4))
    assert sorted(c for order in orders for c in order) == want
    assert ideal.schedule_bubble(schedule, 8, 2, 2) < ideal.schedule_bubble("1f1b", 8, 2)
    assert ideal.schedule_bubble("1f1b", 8, 2) == pytest.approx(ideal.bubble_fraction(8, 2))
    fwd, bwd = [0.5, 1.5, 0.5, 0.5], [1.0, 3.0, 1.0, 1.0]
    assert ideal.simulate_ms(schedule, 4, fwd, bwd) >= 4 * (fwd[1] + bwd[1] + fwd[2] + bwd[2]) - 1e-9


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="schedule"):
        ideal.simulate_ms("zigzag", 2, [1.0], [1.0])
    with pytest.raises(ValueError, match="one forward and one backward"):
        ideal.bubble_bound_ms(2, [1.0, 2.0], [1.0])


def test_report_ratio_and_text():
    rep = ideal.IdealReport("1f1b", 8, (1.0, 1.0), (2.0, 2.0), achieved_ms=30.0)
    assert rep.bound_ms == pytest.approx(27.0)
    assert rep.ratio == pytest.approx(0.9)
    assert "ratio 0.900" in rep.describe()
    assert math.isfinite(rep.as_dict()["simulated_ms"])


def test_stage_times_from_spans_takes_medians_per_stage():
    spans = {
        0: [Span(0, "compute", "F0", 0, 1), Span(0, "compute", "F1", 1, 2.2), Span(0, "compute", "F2", 2.2, 3.2),
            Span(0, "compute", "B0", 5, 7), Span(0, "compute", "B1", 7, 9), Span(0, "compute", "B2", 9, 11),
            Span(0, "p2p", "send act 0", 1, 1.1)],
        1: [Span(1, "compute", "F0", 1, 4), Span(1, "compute", "B0", 4, 10)],
    }
    fwd, bwd = ideal.stage_times_from_spans(spans, pp=2)
    assert fwd == pytest.approx([1.0, 3.0])
    assert bwd == pytest.approx([2.0, 6.0])
    with pytest.raises(ValueError):
        ideal.stage_times_from_spans({0: spans[0]}, pp=2)


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16)])
def test_schedule_ceiling_is_the_fill_the_last_rank_cannot_avoid(pp, m):
    """The bubble-free record's ceiling: 1F1B's is M / (M + P - 1); ZB-V's is the last rank's work over that work
    plus its wait for the first forward to cross the P - 1 chunks before its own (a chunk's forward is 1/6 of its
    forward + backward per microbatch, and each rank holds two chunks)."""
    from peerline.bench.suites.bubble_free import schedule_ceiling
    from peerline.bench.suites.pipeline import CONFIGS

    shape = dataclasses.replace(CONFIGS["compute"], microbatches=m)
    assert schedule_ceiling("1f1b graph", shape, pp) == pytest.approx(m / (m + pp - 1))
    work = 2 * m * 3  # two chunks per rank, F + B + W of one unit each per microbatch
    assert schedule_ceiling("zbv graph bf16", shape, pp) == pytest.approx(work / (work + pp - 1))
    assert schedule_ceiling("zb-h1 graph", shape, pp) < schedule_ceiling("zbv graph", shape, pp) < 1.0
