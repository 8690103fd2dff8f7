"""Whether two training recipes learn alike: their loss curves (--metrics-jsonl files) compared against the noise
of the reference run and, given several runs of the reference recipe, against how far those runs drift apart.

The noise is the reference's own iteration-to-iteration scatter after the first `skip` iterations (`noise`; with
several reference runs, their mean). Each run's curve is its moving average over `window` iterations; a run
matches the reference when, over the iterations both logged after the first `skip` (the steep start, where any two
recipes differ most), the largest gap between the two curves is within `bound` x the noise, and the mean loss of
the last `window` iterations is within `bound` x noise / sqrt(window) x sqrt(2) (two independent means). Those
thresholds treat the noise as independent, but a large model's curves drift apart chaotically after a while, even
two runs of one recipe with different seeds. So with several reference runs each allowed gap is the larger of the
noise's and `bound` x the largest gap between the reference runs themselves (`Spread`, measured the same way), and
a run's gaps are its largest against any reference run, as if it were one more run of the reference recipe. A
recipe that trains differently (a lost update, a wrong gradient) still stands out: its gap grows beyond both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
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
class Spread:
    """How far runs of the reference recipe drift apart: the largest gap of their smoothed curves and the largest gap
    of their final means over every pair of runs."""

    runs: int
    max_gap: float
    final_gap: float


@dataclass(frozen=True)
class Comparison:
    """One run against the reference: the largest gap of the smoothed curves, the gap of the final means, the
    reference's noise and whether both gaps are within bounds; with several reference runs also their spread and
    the two allowed gaps."""

    iterations: int
    max_gap: float
    final_gap: float
    noise: float
    matches: bool
    spread: Spread | None = None
    allowed_gap: float = 0.0
    allowed_final: float = 0.0
    noise_gap: float = 0.0
    noise_final: float = 0.0

    def describe(self, name: str, reference: str) -> str:
        verdict = "matches" if self.matches else "does NOT match"
        line = (f"{name} {verdict} {reference} over {self.iterations} iterations: largest gap of the smoothed "
                f"curves {self.max_gap:.4f}, of the final means {self.final_gap:+.4f}; ")
        if self.spread is None:
            return line + f"the reference's noise {self.noise:.4f}"
        noise = f"the reference's noise {self.noise:.4f}"
        runs = f"the reference runs' own spread {self.spread.max_gap:.4f} ({self.spread.runs} runs)"
        by_spread = (self.allowed_gap > self.noise_gap, self.allowed_final > self.noise_final)
        allowed = f"allowed {self.allowed_gap:.4f} and {self.allowed_final:.4f}"
        if by_spread == (True, True):
            return line + f"{allowed} by {runs}, of their final means {self.spread.final_gap:.4f}"
        if by_spread == (False, False):
            return line + f"{allowed} by {noise} (its {self.spread.runs} runs spread less)"
        if by_spread == (True, False):
            return line + f"allowed {self.allowed_gap:.4f} by {runs}, {self.allowed_final:.4f} by {noise}"
        return (line + f"allowed {self.allowed_gap:.4f} by {noise}, {self.allowed_final:.4f} by the reference runs' "
                f"final means {self.spread.final_gap:.4f} apart ({self.spread.runs} runs)")


def _gaps(a: list[float], b: list[float], window: int, skip: int) -> tuple[float, float]:
    """The largest gap of the smoothed curves after `skip` and the gap of the final means (b's minus a's)."""
    a_s, b_s = moving_average(a, window), moving_average(b, window)
    max_gap = max(abs(x - y) for x, y in zip(a_s[skip:], b_s[skip:], strict=True))
    return max_gap, sum(b[-window:]) / window - sum(a[-window:]) / window


def check_references(references: Sequence[dict[int, float]]) -> None:
    """ValueError unless every reference run logged the same iterations (their gaps are measured pointwise)."""
    first = set(references[0])
    for k, other in enumerate(references[1:], start=2):
        if set(other) != first:
            raise ValueError(f"reference runs log different iterations: run 1 has {len(first)}, run {k} has "
                             f"{len(other)}" + ("" if len(other) != len(first) else " (not the same ones)"))


def compare(reference: dict[int, float] | Sequence[dict[int, float]], run: dict[int, float],
            window: int = DEFAULT_WINDOW, skip: int = DEFAULT_SKIP, bound: float = DEFAULT_BOUND) -> Comparison:
    """`run` against `reference` (one run, or a list of runs of the reference recipe) over the iterations all
    logged."""
    references = [reference] if isinstance(reference, dict) else list(reference)
    if not references:
        raise ValueError("no reference run")
    check_references(references)
    common = sorted(set(references[0]) & set(run))
    if len(common) < skip + 2 * window:
        raise ValueError(f"{len(common)} common iterations; at least {skip + 2 * window} are needed "
                         f"(skip {skip} + two windows of {window})")
    refs = [[r[i] for i in common] for r in references]
    got = [run[i] for i in common]
    sigma = sum(noise(ref[skip:]) for ref in refs) / len(refs)
    gaps = [_gaps(ref, got, window, skip) for ref in refs]
    max_gap = max(g for g, _ in gaps)
    final_gap = max((f for _, f in gaps), key=abs)
    noise_gap, noise_final = bound * sigma, bound * sigma * math.sqrt(2 / window)
    if len(refs) == 1:
        ok = max_gap <= noise_gap and abs(final_gap) <= noise_final
        return Comparison(len(common), max_gap, final_gap, sigma, ok)
    pairs = [_gaps(refs[i], refs[j], window, skip) for i in range(len(refs)) for j in range(i + 1, len(refs))]
    spread = Spread(len(refs), max(g for g, _ in pairs), max(abs(f) for _, f in pairs))
    allowed_gap = max(noise_gap, bound * spread.max_gap)
    allowed_final = max(noise_final, bound * spread.final_gap)
    ok = max_gap <= allowed_gap and abs(final_gap) <= allowed_final
    return Comparison(len(common), max_gap, final_gap, sigma, ok, spread, allowed_gap, allowed_final, noise_gap,
                      noise_final)


def plot(curves: dict[str, dict[int, float] | Sequence[dict[int, float]]], window: int, path: Path,
         title: str) -> Path | None:
    """Raw losses (thin) and their moving averages (thick) of every run in one PNG; a name with several runs (the
    reference's, say) gets every run, each in a shade of one colour, raw losses faint and moving averages thin.
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import to_rgb
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, entry in curves.items():
        runs = [entry] if isinstance(entry, dict) else list(entry)
        if len(runs) == 1:
            its = sorted(runs[0])
            values = [runs[0][i] for i in its]
            (line,) = ax.plot(its, values, linewidth=0.6, alpha=0.35)
            ax.plot(its, moving_average(values, window), linewidth=2.0, color=line.get_color(), label=name)
            continue
        base = None
        for k, losses in enumerate(runs):
            its = sorted(losses)
            values = [losses[i] for i in its]
            shade = 0.55 * k / (len(runs) - 1)  # the first run in the colour itself, the others towards white
            color = None if base is None else tuple(c + (1.0 - c) * shade for c in base)
            (line,) = ax.plot(its, values, linewidth=0.4, alpha=0.2, color=color)
            base = base or to_rgb(line.get_color())
            color = color or base
            ax.plot(its, moving_average(values, window), linewidth=1.0, color=color,
                    label=f"{name} ({len(runs)} runs)" if k == 0 else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["Comparison", "Spread", "check_references", "compare", "moving_average", "noise", "plot", "read_losses"]
