"""Schedules as data: built for GPipe, 1F1B and ZB-H1, validated without running a model."""

import pytest

from peerline.distributed.pipeline import schedule as S
from peerline.distributed.pipeline import timed


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_every_schedule_runs_to_the_end_on_rendezvous_and_rings(name, stages, extra):
    m = stages + extra
    programs = S.build(name, stages, m)
    order = S.simulate(programs, None)  # NCCL-like rendezvous
    assert sorted((s, str(a)) for s, step in order for a in step) == \
        sorted((s, str(a)) for s, p in enumerate(programs) for step in p for a in step)
    k = S.min_capacity(programs)
    assert 1 <= k <= m


def test_1f1b_needs_fewer_slots_than_gpipe():
    assert S.min_capacity(S.build("1f1b", 4, 8)) < S.min_capacity(S.build("gpipe", 4, 8))
    assert S.min_capacity(S.build("gpipe", 4, 8)) == 8


def test_1f1b_keeps_at_most_stages_minus_index_microbatches_alive():
    for stage, program in enumerate(S.build("1f1b", 4, 8)):
        alive = peak = 0
        for step in program:
            alive += step[0].op == "F"
            alive -= step[0].op == "B"
            peak = max(peak, alive)
        assert peak == 4 - stage


def test_1f1b_with_fewer_microbatches_than_stages_is_a_clear_error():
    with pytest.raises(S.ScheduleError, match="at least as many microbatches as stages"):
        S.build("1f1b", 4, 3)


def test_unknown_schedule():
    with pytest.raises(S.ScheduleError, match="unknown schedule"):
        S.build("zigzag", 2, 2)


def test_backward_before_forward_is_rejected():
    programs = [S.parse_program("B0 F0")]
    with pytest.raises(S.ScheduleError, match="F0 .* must come before B0"):
        S.simulate(programs)


def test_unmatched_send_is_reported_with_a_table():
    # Stage 1 waits for gradient 0 from nobody... build a pair where both stages receive first: deadlock.
    programs = [S.parse_program("RG0 F0 SA0 B0"), S.parse_program("RA0 F0 B0 SG0")]
    with pytest.raises(S.ScheduleError) as err:
        S.simulate(programs)
    assert "RG0" in str(err.value) or "must come before" in str(err.value)


def test_cross_sends_deadlock_on_rendezvous_but_not_when_grouped():
    # stage 0 sends act 1 then receives grad 0; stage 1 sends grad 0 then receives act 1: as separate steps
    # both sit in a send (rendezvous) -> deadlock; as groups the pair completes.
    bad = [S.parse_program("F0 SA0 F1 SA1 RG0 B0 RG1 B1"),
           S.parse_program("RA0 F0 B0 SG0 RA1 F1 B1 SG1")]
    with pytest.raises(S.ScheduleError, match="deadlocks"):
        S.simulate(bad, None)
    good = [S.parse_program("F0 SA0 F1 SA1+RG0 B0 RG1 B1"),
            S.parse_program("RA0 F0 B0 SG0+RA1 F1 B1 SG1")]
    S.simulate(good, None)
    S.simulate(bad, 2)  # with two buffered slots the separate sends complete


def test_ring_too_small_is_detected():
    programs = S.build("gpipe", 2, 4)
    with pytest.raises(S.ScheduleError, match="1 slot"):
        S.simulate(programs, 1)


def test_parse_and_render_round_trip():
    text = "RA0 F0 SA0+RG0 B0 SG0"
    steps = S.parse_program(text)
    assert " ".join(S.step_str(s) for s in steps) == text
    assert "stage 0" in S.render([steps])
    with pytest.raises(S.ScheduleError):
        S.parse_program("X0")


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_zb_h1_runs_any_m_and_splits_every_backward(stages, m):
    programs = S.build("zb-h1", stages, m)
    S.simulate(programs, None)
    S.simulate(programs, S.min_capacity(programs))
    assert S.splits_backward(programs)
    for p in programs:
        ops = [step[0] for step in p if step[0].op in S.COMPUTE]
        assert sorted(str(a) for a in ops) == sorted(f"{op}{mb}" for op in "FBW" for mb in range(m))


@pytest.mark.parametrize("stages,m", [(2, 4), (4, 8), (4, 6), (8, 16)])
def test_zb_h1_reaches_its_bubble_bound(stages, m):
    """Unit F, B, W: 1F1B takes 3m + 3(p-1), ZB-H1 3m + (p-1) (F + B - W)."""
    orders = [[(step[0].op, step[0].mb) for step in p if step[0].op in S.COMPUTE]
              for p in S.build("zb-h1", stages, m)]
    assert timed.makespan(orders) == 3 * m + (stages - 1)
    one_f = [[(step[0].op, step[0].mb) for step in p if step[0].op in S.COMPUTE] for p in S.build("1f1b", stages, m)]
    assert timed.makespan(one_f, split=False) == 3 * m + 3 * (stages - 1)


def test_w_before_its_b_is_rejected():
    good = S.build("zb-h1", 2, 2)
    text = " ".join(S.step_str(st) for st in good[1])
    bad = text.replace("B0", "X").replace("W0", "B0").replace("X", "W0")
    with pytest.raises(S.ScheduleError, match="B0 .* must come before W0"):
        S.simulate([good[0], S.parse_program(bad)])


def test_missing_w_is_rejected():
    good = S.build("zb-h1", 2, 3)
    bad = [step for step in good[0] if step != (S.Action("W", 1),)]
    with pytest.raises(S.ScheduleError, match="microbatch 1 has no W"):
        S.simulate([bad, good[1]])


def test_zb_h1_missing_send_is_reported_with_its_table():
    good = S.build("zb-h1", 2, 3)
    stage0 = [tuple(a for a in step if a != S.Action("SA", 2)) for step in good[0]]
    stage0 = [step for step in stage0 if step]
    with pytest.raises(S.ScheduleError, match="microbatch 2 has no SA"):
        S.simulate([stage0, good[1]])
    # the stage program alone passes when the receive is dropped too: then the other stage waits -> the table
    stage1 = [tuple(a for a in step if a != S.Action("RA", 2)) for step in good[1]]
    with pytest.raises(S.ScheduleError) as err:
        S.check_program(1, 2, 3, [step for step in stage1 if step])
    assert "no RA" in str(err.value)
    starved = [step for step in good[1]]
    starved.insert(0, (S.Action("RA", 2),))
    starved = [step for i, step in enumerate(starved) if not (i > 0 and step == (S.Action("RA", 2),))]
    with pytest.raises(S.ScheduleError, match="deadlocks") as err:
        S.simulate([good[0], starved], None)
    assert "stage 1" in str(err.value) and ">" in str(err.value)


def test_w_holds_its_slots_until_it_runs():
    """A split stage frees what it received only after W: ZB-H1 needs deeper rings than 1F1B."""
    assert S.min_capacity(S.build("zb-h1", 4, 8)) > S.min_capacity(S.build("1f1b", 4, 8))
    programs = S.build("zb-h1", 2, 4)
    with pytest.raises(S.ScheduleError, match="slot"):
        S.simulate(programs, S.min_capacity(programs) - 1)


def test_render_shows_b_and_w():
    table = S.render(S.build("zb-h1", 2, 2))
    assert "W0" in table and "B0" in table and "weight gradient" in table


@pytest.mark.parametrize("stages,m", [(2, 4), (2, 8), (2, 16)])
def test_zb_h1_first_stage_runs_a_weight_pass_before_waiting_for_the_next_gradient(stages, m):
    """The first stage's B does nothing (its input is the data) and its W is the whole backward, so its W(j) runs in
    the time the next gradient takes to come back: it comes before the receive of gradient j + 1 (waiting for that
    receive first leaves the first stage idle for a backward pass of the next stage)."""
    programs = S.build("zb-h1", stages, m, rendezvous=False)
    S.simulate(programs, S.min_capacity(programs))
    steps = [S.step_str(st) for st in programs[0]]
    for j in range(m - 2):
        w = steps.index(f"W{j}")
        rg = next(i for i, st in enumerate(steps) if f"RG{j + 1}" in st.split("+"))
        assert w < rg, " ".join(steps)
    assert timed.action_cost("B", 0, True, first_stage_whole_w=True) == 0
    assert timed.action_cost("W", 0, True, first_stage_whole_w=True) == 2


@pytest.mark.parametrize("stages,m", [(2, 8), (4, 8), (8, 16)])
def test_zb_h1_ring_order_is_faster_where_the_first_stage_does_its_backward_in_w(stages, m):
    """With the first stage's costs as the engine has them (B nothing, W the whole backward), the ring order
    reaches 3m + (p - 1) units and the rendezvous order takes longer; the rendezvous order still runs on a
    rendezvous transport (the test above), the ring order needs its slots."""
    def compute(programs):
        return [[(st[0].op, st[0].mb) for st in p if st[0].op in S.COMPUTE] for p in programs]

    ring = S.build("zb-h1", stages, m, rendezvous=False)
    rendezvous = S.build("zb-h1", stages, m)
    assert timed.makespan(compute(ring), first_stage_whole_w=True) == 3 * m + (stages - 1)
    assert timed.makespan(compute(rendezvous), first_stage_whole_w=True) > 3 * m + (stages - 1)
    with pytest.raises(S.ScheduleError, match="deadlocks"):
        S.simulate(ring, None)


def test_programs_follow_the_edges_of_the_whole_job():
    from peerline.distributed.assemble import programs_for_edges
    from peerline.distributed.p2p.edges import COPY_ENGINE, Edge

    ring, rendezvous = S.build("zb-h1", 2, 4, rendezvous=False), S.build("zb-h1", 2, 4)
    copy = Edge(0, 1, "a", "a", COPY_ENGINE)
    assert programs_for_edges(rendezvous, ring, [copy, Edge(2, 3, "a", "a", COPY_ENGINE)]) is ring
    assert programs_for_edges(rendezvous, ring, [copy, Edge(2, 3, "a", "b", "nccl")]) is rendezvous
    assert programs_for_edges(rendezvous, ring, []) is rendezvous  # one stage per rank group: local handoffs


def _held(program) -> int:
    """The most microbatches a stage's program holds at once: forwards whose W (or unsplit B) has not run."""
    held = peak = 0
    split = any(step[0].op == "W" for step in program)
    for step in program:
        op = step[0].op
        held += op == "F"
        held -= op == ("W" if split else "B")
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("rendezvous", [True, False])
def test_zb_h1_within_1f1b_memory_holds_what_1f1b_holds(stages, m, rendezvous):
    """--zb-memory 1f1b: every stage holds at most 1F1B's n_stages - s microbatches, its deferred Ws counted; the
    programs run on rendezvous and rings, every F, B and W once; the unit-time makespan lies between ZB-H1's
    (fast) and 1F1B's."""
    programs = S.build("zb-h1", stages, m, rendezvous=rendezvous, memory="1f1b")
    S.simulate(programs, None)
    S.simulate(programs, S.min_capacity(programs))
    for s, p in enumerate(programs):
        assert _held(p) <= min(m, stages - s), (s, S.render(programs))
        ops = [step[0] for step in p if step[0].op in S.COMPUTE]
        assert sorted(str(a) for a in ops) == sorted(f"{op}{mb}" for op in "FBW" for mb in range(m))
    fast = S.build("zb-h1", stages, m, rendezvous=rendezvous)
    assert max(_held(p) for p in fast) >= max(_held(p) for p in programs)

    def span(progs, split=True):
        return timed.makespan([[(st[0].op, st[0].mb) for st in p if st[0].op in S.COMPUTE] for p in progs],
                              split=split, first_stage_whole_w=not rendezvous)

    if m >= stages and rendezvous:
        assert span(fast) <= span(programs) <= span(S.build("1f1b", stages, m), split=False)


def test_zb_h1_fast_holds_more_than_1f1b_at_pp4():
    """What --zb-memory 1f1b is for: the default order keeps deferred Ws on top of 1F1B's microbatches."""
    fast = [_held(p) for p in S.build("zb-h1", 4, 8)]
    capped = [_held(p) for p in S.build("zb-h1", 4, 8, memory="1f1b")]
    assert capped == [4, 3, 2, 1] and all(f > c for f, c in zip(fast, capped))


@pytest.mark.parametrize("device,overrides,whole_w", [
    ("cpu", {}, True),  # the CPU: torch's Linears, split_backward's graph form
    ("cuda", {}, False),  # the default model captured with peerline's kernels: the lean form
    ("cuda", {"model": "gpt"}, False),
    ("cuda", {"graph": False}, True),  # eager: bf16 weights take plain F.linear, the graph form
    ("cuda", {"kernels": "torch"}, True),
    ("cuda", {"model": "lm_models:embedding_lm"}, True),  # a user model: its Linears are its own
])
def test_copy_engine_order_follows_the_first_stages_backward(monkeypatch, device, overrides, whole_w):
    """zb-h1's copy-engine order takes the first stage's B as nothing only where split_backward keeps the graph
    form on every rank; where the lean form is expected its B is a real backward and the rendezvous order is used."""
    import torch

    from peerline.distributed import assemble
    from peerline.distributed.config import RunConfig
    from peerline.kernels import ops

    monkeypatch.setattr(ops, "resolve_impl", lambda impl, dev: "torch" if dev.type != "cuda" else impl)
    cfg = RunConfig(schedule="zb-h1", **overrides)
    assert assemble.whole_w_first_stage(cfg, torch.device(device)) is whole_w
    lean = S.build("zb-h1", 4, 8, rendezvous=not whole_w)
    spans = [timed.makespan([[(st[0].op, st[0].mb) for st in p if st[0].op in S.COMPUTE] for p in programs])
             for programs in (lean, S.build("zb-h1", 4, 8, rendezvous=whole_w))]
    if not whole_w:  # with every stage's unit costs, the order chosen is the shorter one (27 against 28 units)
        assert spans[0] < spans[1]
