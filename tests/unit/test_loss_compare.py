"""launch/compare_losses.py and distributed/observe/loss_compare.py: a run with the reference's dynamics and fresh
noise matches it; a run that learns slower (as a recipe losing small updates would) does not; bad input is one line.
With several reference runs that drift apart (as a large model's runs with different seeds do), a run drifting as
far passes where one reference run's noise alone would fail it, and a run that stops learning still fails."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from peerline.distributed.observe import loss_compare
from peerline.launch import compare_losses


def curve(seed: int, rate: float = 0.02, sigma: float = 0.05, iterations: int = 200) -> dict[int, float]:
    rng = random.Random(seed)
    return {i: 2.0 + 6.0 * math.exp(-rate * i) + rng.gauss(0.0, sigma) for i in range(1, iterations + 1)}


def write(path: Path, losses: dict[int, float]) -> Path:
    path.write_text("".join(json.dumps({"iteration": i, "loss": v, "ms_per_iter": 1.0}) + "\n"
                            for i, v in losses.items()))
    return path


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_same_dynamics_with_fresh_noise_match(seed: int) -> None:
    assert loss_compare.compare(curve(100 + seed), curve(seed)).matches


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_slower_learning_does_not_match(seed: int) -> None:
    result = loss_compare.compare(curve(100 + seed), curve(seed, rate=0.016))
    assert not result.matches and result.final_gap > 0


def test_noise_is_the_scatter_not_the_trend() -> None:
    losses = list(curve(5, sigma=0.05).values())
    assert 0.04 < loss_compare.noise(losses[20:]) < 0.06
    assert loss_compare.noise([3.0 - 0.01 * i for i in range(100)]) < 1e-9
    assert loss_compare.moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_too_few_iterations_are_refused() -> None:
    with pytest.raises(ValueError, match="common iterations"):
        loss_compare.compare(curve(1, iterations=40), curve(2, iterations=40))


def test_cli_exit_status_and_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, same, slow = (write(tmp_path / f"{n}.jsonl", c) for n, c in
                       (("ref", curve(7)), ("same", curve(8)), ("slow", curve(9, rate=0.016))))
    assert compare_losses.main([f"master={ref}", f"bf16={same}"]) == 0
    assert "bf16 matches master over 200 iterations" in capsys.readouterr().out
    assert compare_losses.main([f"master={ref}", f"bf16={same}", f"lossy={slow}"]) == 1
    assert "lossy does NOT match master" in capsys.readouterr().out
    assert compare_losses.main([f"master={ref}", str(same)]) == 2
    assert capsys.readouterr().err.startswith("peerline: error: ")
    assert compare_losses.main([f"master={ref}", f"x={tmp_path / 'missing.jsonl'}"]) == 2
    assert compare_losses.main([f"master={ref}"]) == 2


def drifting(seed: int, drift: float, stall: int | None = None, sigma: float = 0.05) -> dict[int, float]:
    """`curve`'s dynamics and fresh noise, plus a drift that starts at iteration 80 and grows linearly to `drift` at
    iteration 200 (runs of one recipe parting chaotically); with `stall`, the loss stops decreasing there."""
    rng = random.Random(seed)
    out = {}
    for i in range(1, 201):
        trend = 2.0 + 6.0 * math.exp(-0.02 * min(i, stall or i))
        out[i] = trend + drift * max(0, i - 80) / 120 + rng.gauss(0.0, sigma)
    return out


D = 0.2  # how far the two reference runs drift apart (about 4x their noise)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_drift_within_the_reference_runs_spread_matches(seed: int) -> None:
    refs = [drifting(10 * seed, 0.0), drifting(10 * seed + 1, D)]
    run = drifting(10 * seed + 2, -D)  # D from one reference run, 2 D from the other: under 3 D
    alone = loss_compare.compare(refs[0], run)
    assert not alone.matches and alone.spread is None
    both = loss_compare.compare(refs, run)
    assert both.matches, both.describe("run", "ref")
    assert both.spread is not None and both.spread.runs == 2 and 0.5 * D < both.spread.max_gap < 1.5 * D
    assert both.allowed_gap == 3.0 * both.spread.max_gap and both.allowed_final == 3.0 * both.spread.final_gap
    assert both.max_gap > 1.5 * D  # measured against the farther reference run
    assert "the reference runs' own spread" in both.describe("run", "ref")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_run_that_stops_learning_fails_despite_the_spread(seed: int) -> None:
    refs = [drifting(10 * seed, 0.0), drifting(10 * seed + 1, D)]
    result = loss_compare.compare(refs, drifting(10 * seed + 2, 0.0, stall=80))
    assert not result.matches and result.final_gap > result.allowed_final, result.describe("lossy", "ref")
    assert result.allowed_gap == 3.0 * result.spread.max_gap


@pytest.mark.parametrize("seed", [1, 2])
def test_reference_runs_that_do_not_part_leave_the_noise_as_the_yardstick(seed: int) -> None:
    ref = drifting(50 + seed, 0.0)
    for run in (drifting(60 + seed, 0.0), drifting(60 + seed, -D)):
        single, several = loss_compare.compare(ref, run), loss_compare.compare([ref, dict(ref)], run)
        assert several.spread is not None and several.spread.max_gap == 0.0
        assert (several.matches, several.max_gap, several.final_gap) == (single.matches, single.max_gap,
                                                                         single.final_gap)
        assert (several.allowed_gap, several.allowed_final) == (several.noise_gap, several.noise_final)
        assert "by the reference's noise" in several.describe("run", "ref")


def test_cli_several_reference_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, run, run2, lossy = (write(tmp_path / f"{n}.jsonl", c) for n, c in (
        ("a", drifting(61, 0.0)), ("b", drifting(62, D)), ("run", drifting(63, -D)), ("run2", drifting(64, 0.5 * D)),
        ("lossy", drifting(65, 0.0, stall=80))))
    assert compare_losses.main([f"master={a}", f"bf16={run}"]) == 1
    assert "bf16 does NOT match master" in capsys.readouterr().out
    assert compare_losses.main([f"master={a},{b}", f"bf16={run},{run2}", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bf16#1 matches master over 200 iterations") and "(2 runs)" in out[0]
    assert out[1].startswith("bf16#2 matches master") and (tmp_path / "p.png").stat().st_size > 0
    assert compare_losses.main([f"master={a},{b}", f"bf16={run}", f"lossy={lossy}"]) == 1
    assert "lossy does NOT match master" in capsys.readouterr().out


def test_cli_bad_input_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, run = (write(tmp_path / f"{n}.jsonl", drifting(70 + k, 0.0)) for k, n in enumerate(("a", "b", "run")))
    short = write(tmp_path / "short.jsonl", dict(list(drifting(74, 0.0).items())[:150]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"iteration": 1, "ms_per_iter": 1.0}) + "\n")
    cases = [
        ([f"master={a},{tmp_path / 'missing.jsonl'}", f"bf16={run}"], "cannot read losses from"),
        ([f"master={a},{b}", str(run)], "is not NAME=FILE"),
        ([f"master={a},", f"bf16={run}"], "is not NAME=FILE"),
        ([f"master={a},{empty}", f"bf16={run}"], "holds no finite losses"),
        ([f"master={a},{short}", f"bf16={run}"], "error: master: reference runs log different iterations: run 1 "
                                                 "has 200, run 2 has 150"),
    ]
    for argv, message in cases:
        assert compare_losses.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("peerline: error: ") and message in lines[0], (argv, lines)
    with pytest.raises(ValueError, match="different iterations"):
        loss_compare.compare([drifting(1, 0.0), dict(list(drifting(2, 0.0).items())[:150])], drifting(3, 0.0))
