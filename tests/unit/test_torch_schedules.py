"""The anchor's candidates (bench/suites/torch_schedules.py): where each torch schedule puts its stages, which
apply to a shape and why not, and the search that keeps the fastest (shared by the pipeline and gpt suites)."""

from __future__ import annotations

import random

import pytest
import torch

from peerline.bench.benchkit import Timing
from peerline.bench.runtime_timing import Measured
from peerline.bench.suites import torch_schedules as ts


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_every_stage_is_placed_once(pp):
    for name, spec in ts.TORCH_SCHEDULES.items():
        placed = [sid for rank in range(pp) for sid in ts.stage_ids(name, rank, pp)]
        assert sorted(placed) == list(range(pp * spec.per_rank)), name
    assert ts.stage_ids("zbv", 0, 4) == [0, 7] and ts.stage_ids("interleaved-zb", 1, 4) == [1, 5]


def test_every_schedule_exists_in_this_torch():
    for name in ts.TORCH_SCHEDULES:
        assert ts.schedule_class(name) is not None, name


def test_why_not_names_each_condition():
    assert ts.why_not("zbv", 1, 8, 8) == "needs 2 or more pipeline ranks"
    assert "DDP" in ts.why_not("interleaved-1f1b", 2, 8, 8, dp=2)
    assert ts.why_not("1f1b", 2, 8, 8, dp=2) is None
    assert ts.why_not("interleaved-1f1b", 4, 6, 8) == "6 layers are too few for 8 stages"
    assert ts.why_not("interleaved-zb", 4, 16, 9) == "M=9 is not a multiple of its 2 rounds (M // pp)"
    assert ts.why_not("interleaved-1f1b", 4, 16, 3) is None  # one round
    assert ts.why_not("dualpipev", 2, 8, 3) == "M=3 is fewer than its 4 stages"
    assert ts.why_not("1f1b", 4, 8, 2) == "M=2 is fewer than the 4 stages"


def test_candidates_note_what_does_not_apply_and_refuse_unknown_names():
    notes: list[str] = []
    pairs = ts.candidates(None, ["bf16-params", "autocast"], 2, 4, 4, 2, notes.append, what="pipeline quick")
    assert pairs == [("1f1b", "bf16-params"), ("1f1b", "autocast"), ("gpipe", "bf16-params"), ("gpipe", "autocast")]
    assert len(notes) == 4 and all("not tried: DDP over several stages per rank" in n for n in notes), notes
    assert ts.candidates(["zbv", "gpipe"], ["fp32"], 2, 4, 4, 1, notes.append) == [("gpipe", "fp32"),
                                                                                     ("zbv", "fp32")]
    with pytest.raises(ValueError, match="unknown torch schedule 'looped'"):
        ts.candidates(["looped"], ["fp32"], 2, 4, 4, 1, notes.append)
    with pytest.raises(ValueError, match="unknown precision recipe 'fp8'"):
        ts.candidates(None, ["fp8"], 2, 4, 4, 1, notes.append)
    assert ts.recipes_for("bf16") == ["bf16-params", "autocast"] and ts.recipes_for("fp32") == ["fp32"]
    assert ts.param_dtype("bf16-params") == torch.bfloat16 and ts.param_dtype("autocast") == torch.float32


class FakeContext:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, what: str) -> None:
        self.steps.append(what)


def test_fastest_keeps_the_quickest_and_lists_every_candidate():
    times = {pair: random.uniform(1.0, 50.0) for pair in [("1f1b", "fp32"), ("gpipe", "fp32"), ("zbv", "fp32")]}

    def measure(schedule: str, recipe: str) -> Measured:
        if schedule == "gpipe":
            raise RuntimeError("no such luck")
        ms = times[(schedule, recipe)]
        return Measured(f"torch {schedule}", Timing(ms, ms, ms, 1), [1.0, 0.5], None, 0.0)

    failures: list[str] = []
    ctx = FakeContext()
    measured, best = ts.fastest(ctx, "quick torch", list(times), measure, failures)
    assert set(measured) == {"1f1b fp32", "zbv fp32"} and len(failures) == 1 and "gpipe" in failures[0]
    want = min(("1f1b", "zbv"), key=lambda s: times[(s, "fp32")])
    assert (best.extra["schedule"], best.extra["recipe"]) == (want, "fp32")
    assert set(best.extra["candidates"]) == {"1f1b fp32", "zbv fp32"}
    assert ctx.steps == ["quick torch 1f1b fp32", "quick torch gpipe fp32", "quick torch zbv fp32"]
    assert ts.describe_candidates(measured, best).endswith(f"fastest: {want} fp32")
    assert ts.fastest(ctx, "none", [], measure, failures) == ({}, None)


def test_with_blocks_gives_no_compiled_candidate_to_a_split_backward():
    notes: list[str] = []
    pairs = [("1f1b", "autocast"), ("zbv", "autocast"), ("zbv", "bf16-params"), ("interleaved-1f1b", "autocast")]
    got = ts.with_blocks(pairs, ["eager", "compiled"], notes.append, what="gpt compute-bound")
    assert got == [("1f1b", "autocast", "eager"), ("1f1b", "autocast", "compiled"), ("zbv", "autocast", "eager"),
                   ("zbv", "bf16-params", "eager"), ("interleaved-1f1b", "autocast", "eager"),
                   ("interleaved-1f1b", "autocast", "compiled")]
    assert len(notes) == 1 and "ScheduleZBVZeroBubble with compiled blocks not tried" in notes[0], notes
    assert ts.with_blocks(pairs[:1], ["eager"], notes.append) == [("1f1b", "autocast", "eager")]
    assert {s for s, spec in ts.TORCH_SCHEDULES.items() if spec.splits_backward} == {"interleaved-zb", "zbv",
                                                                                      "dualpipev"}
    with pytest.raises(ValueError, match="unknown blocks 'jit'"):
        ts.with_blocks(pairs, ["jit"], notes.append)


def test_fastest_names_every_axis_of_a_candidate():
    times = {("1f1b", "fp32", "eager"): 3.0, ("1f1b", "fp32", "compiled"): 2.0, ("gpipe", "fp32", "eager"): 4.0}

    def measure(schedule: str, recipe: str, blocks: str) -> Measured:
        ms = times[(schedule, recipe, blocks)]
        return Measured(f"torch {schedule}", Timing(ms, ms, ms, 1), [1.0], None, 0.0)

    measured, best = ts.fastest(FakeContext(), "t", list(times), measure, [], axes=ts.AXES_WITH_BLOCKS)
    assert list(measured) == ["1f1b fp32 eager", "1f1b fp32 compiled", "gpipe fp32 eager"]
    assert (best.extra["schedule"], best.extra["recipe"], best.extra["blocks"]) == ("1f1b", "fp32", "compiled")
    assert ts.candidate_name(measured, best) == "1f1b fp32 compiled"
    assert ts.describe_candidates(measured, best).endswith("fastest: 1f1b fp32 compiled")
    measured["gpipe fp32 eager"].timing = Timing(4.0, 4.0, 4.0, 1, host_lead_ms=0.25)
    assert "gpipe fp32 eager 4.00 (host lead 0.2 ms); fastest" in ts.describe_candidates(measured, best)
