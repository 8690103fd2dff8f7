"""Whether two training runs learn alike: their loss curves (--metrics-jsonl files) compared against the noise of
the reference run itself.

The noise is the reference's own iteration-to-iteration scatter after the first `skip` iterations (`noise`). Each
run's curve is its moving average over `window` iterations; a run matches the
reference when, over the iterations both logged after the first `skip` (the steep start, where any two recipes
differ most), the largest gap between the two curves is within `bound` x the noise, and the mean loss of the last
`window` iterations is within `bound` x noise / sqrt(window) x sqrt(2) (two independent means). Both thresholds
are the statistics of one run against itself, so a recipe that trains differently (a lost update, a wrong
gradient) stands out however noisy the data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WINDOW = 20
DEFAULT_SKIP = 20
DEFAULT_BOUND = 3.0


def read_losses(path: Path) -> dict[int, float]:
    """{iteration: loss} of a --metrics-jsonl file (lines without a finite loss skipped)."""
    losses = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        loss = row.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            losses[int(row["iteration"])] = float(loss)
    return losses


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value's trailing window (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def noise(values: list[float]) -> float:
    """The iteration-to-iteration scatter of `values`: the standard deviation of their second differences over
    sqrt(6) (independent noise of deviation s gives second differences of deviation s sqrt(6); a smooth trend
    adds almost nothing)."""
    second = [values[i + 1] - 2 * values[i] + values[i - 1] for i in range(1, len(values) - 1)]
    if not second:
        return 0.0
    mean = sum(second) / len(second)
    return math.sqrt(sum((d - mean) ** 2 for d in second) / max(1, len(second) - 1) / 6)


@dataclass(frozen=True)
class Comparison:
    """One run against the reference: the largest gap of the smoothed curves, the gap of the final means, the
    reference's noise and whether both gaps are within bounds."""

    iterations: int
    max_gap: float
    final_gap: float
    noise: float
    matches: bool

    def describe(self, name: str, reference: str) -> str:
        verdict = "matches" if self.matches else "does NOT match"
        return (f"{name} {verdict} {reference} over {self.iterations} iterations: largest gap of the smoothed "
                f"curves {self.max_gap:.4f}, of the final means {self.final_gap:+.4f}; the reference's noise "
                f"{self.noise:.4f}")


def compare(reference: dict[int, float], run: dict[int, float], window: int = DEFAULT_WINDOW,
            skip: int = DEFAULT_SKIP, bound: float = DEFAULT_BOUND) -> Comparison:
    """`run` against `reference` over the iterations both logged."""
    common = sorted(set(reference) & set(run))
    if len(common) < skip + 2 * window:
        raise ValueError(f"{len(common)} common iterations; at least {skip + 2 * window} are needed "
                         f"(skip {skip} + two windows of {window})")
    ref = [reference[i] for i in common]
    got = [run[i] for i in common]
    sigma = noise(ref[skip:])
    ref_s, got_s = moving_average(ref, window), moving_average(got, window)
    max_gap = max(abs(a - b) for a, b in zip(ref_s[skip:], got_s[skip:], strict=True))
    final_gap = sum(got[-window:]) / window - sum(ref[-window:]) / window
    ok = max_gap <= bound * sigma and abs(final_gap) <= bound * sigma * math.sqrt(2 / window)
    return Comparison(len(common), max_gap, final_gap, sigma, ok)


def plot(curves: dict[str, dict[int, float]], window: int, path: Path, title: str) -> Path | None:
    """Raw losses (thin) and their moving averages (thick) of every run in one PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, losses in curves.items():
        its = sorted(losses)
        values = [losses[i] for i in its]
        (line,) = ax.plot(its, values, linewidth=0.6, alpha=0.35)
        ax.plot(its, moving_average(values, window), linewidth=2.0, color=line.get_color(), label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["Comparison", "compare", "moving_average", "noise", "plot", "read_losses"]
