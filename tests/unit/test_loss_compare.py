"""launch/compare_losses.py and distributed/observe/loss_compare.py: a run with the reference's dynamics and fresh
noise matches it; a run that learns slower (as a recipe losing small updates would) does not; bad input is one line."""

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
