"""--zb-order searched (distributed/pipeline/order_search.py): the searched rank orders of zbv and
zb-interleaved hold the same computes as the list-scheduled ones, never hold more per rank, are no slower under any
judging cost model and faster under the GPU-like one, play on a rendezvous transport, and come out the same on
every call (every rank computes its own)."""

from __future__ import annotations

import pytest

from peerline.distributed.pipeline import order_search, rank_schedule, rank_sim
from peerline.distributed.pipeline.placed import placed_schedule
from peerline.distributed.pipeline.placement import placement_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CASES = [("zbv", 2, 2, 8), ("zb-interleaved", 2, 4, 5), ("zbv", 4, 2, 8)]


def _orders(how: str, schedule: str, pp: int, per_rank: int, m: int) -> list:
    return order_search.run_orders(schedule, placement_for(schedule, pp, per_rank), m, order=how)


@pytest.mark.parametrize("schedule,pp,per_rank,m", CASES)
def test_searched_orders_keep_the_computes_and_the_peak_and_lose_under_no_judge(
        schedule: str, pp: int, per_rank: int, m: int) -> None:
    placement = placement_for(schedule, pp, per_rank)
    listed = _orders("list", schedule, pp, per_rank, m)
    order_search._search.cache_clear()
    searched = _orders("searched", schedule, pp, per_rank, m)
    assert searched != listed
    for got, start, r in zip(searched, listed, range(pp), strict=True):
        assert sorted(got) == sorted(start) and {s for _, s, _ in got} == set(placement.stages_of(r))
        assert order_search.held_peak(got) <= order_search.held_peak(start)
    spans = [(order_search.makespan(searched, placement, j), order_search.makespan(listed, placement, j))
             for j in order_search.JUDGES]
    assert all(s <= base for s, base in spans), spans
    gpu_like = order_search.JUDGES[1]
    assert gpu_like[1] > gpu_like[2] > 0  # B longer than W, a transfer between ranks
    assert spans[1][0] < 0.99 * spans[1][1], spans  # at least 1 % less makespan where B outlasts W
    programs = [rank_schedule.with_rank_messages(o, placement) for o in (searched, listed)]
    rank_sim.simulate_ranks(programs[0], placement, m, None)
    ring, listed_ring = (rank_sim.min_rank_capacity(p, placement, m) for p in programs)
    assert ring <= listed_ring  # the copy engine's ring no deeper
    order_search._search.cache_clear()
    assert _orders("searched", schedule, pp, per_rank, m) == searched  # deterministic


def test_the_list_order_stays_where_every_seed_needs_a_deeper_ring() -> None:
    """zbv at pp=2, M=16: each seed's search ends in orders whose copy-engine ring would be deeper."""
    assert _orders("searched", "zbv", 2, 2, 16) == _orders("list", "zbv", 2, 2, 16)


def test_placed_schedule_runs_the_searched_order() -> None:
    ps = placed_schedule("zbv", 2, 2, 8, order="searched")
    computes = [[c for _, step in program for c in step if c.op in "FBW"] for program in ps.programs]
    searched = order_search.run_orders("zbv", ps.placement, 8, order="searched")
    assert searched != rank_schedule.rank_orders("zbv", ps.placement, 8)
    assert [[(a.op, a.stage, a.mb) for a in program] for program in computes] == searched
    assert ps.min_capacity() >= 1


def test_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="zb order 'best': choose one of list, searched, paper"):
        placed_schedule("zbv", 2, 2, 4, order="best")


def test_interleaved_keeps_its_order_under_searched() -> None:
    """Only the zero-bubble schedules' orders are searched; interleaved 1F1B has no W to move."""
    assert _orders("searched", "interleaved", 2, 2, 4) == _orders("list", "interleaved",
                                                                               2, 2, 4)


def test_a_move_past_a_rank_s_peak_is_not_taken() -> None:
    order = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)]
    assert order_search.held_peak(order) == 2
    assert order_search.held_peak([("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 0, 1)]) == 1


def test_the_start_up_line_says_which_orders_run() -> None:
    """A run with --zb-order searched or paper says at start-up what runs, with the model's figures; list says
    nothing, and so does an order the schedule does not take."""
    def note(schedule: str, m: int, order: str = "list") -> str | None:
        return placed_schedule(schedule, 2, 2, m, order=order).order_note()

    searched = note("zbv", 8, "searched")
    assert searched and "0.979 of the bubble-free time against the list order's 0.953" in searched, searched
    paper = note("zbv", 8, "paper")
    assert paper and paper.startswith("--zb-order paper (the default): zbv runs the zero-bubble paper's rank orders")
    assert "at most 4 forwards awaiting their W per rank against 7" in paper, paper
    assert "the list order runs" in note("zbv", 16, "searched")
    assert note("zbv", 8) is None
    assert note("zb-interleaved", 4, "paper") is None
    assert note("interleaved", 4, "searched") is None
