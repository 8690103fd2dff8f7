"""Schedules as data: built for GPipe and 1F1B, validated without running a model."""

import pytest

from peerline.distributed.pipeline import schedule as S


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
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
