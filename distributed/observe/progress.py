"""What rank 0 shows while training: a rich progress bar on an interactive terminal of a process started alone,
plain lines elsewhere (under torchrun, srun or mpirun, in logs, on a dumb terminal)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from peerline import overrides


def format_stats(stats: Any, total: int) -> str:
    """The progress line of one logged iteration: iter | loss | ppl (LMs) | ms/iter | tokens/s | TFLOP/s (known
    model FLOPs) | MFU (known card) | peak memory (GPU: the smallest and largest of the ranks' peaks)."""
    parts = [f"iter {stats.iteration}/{total}", f"loss {stats.loss:.6f}"]
    if getattr(stats, "ppl", None) is not None:
        parts.append(f"ppl {stats.ppl:.2f}")
    parts += [f"{stats.ms:.2f} ms/iter", f"{stats.tokens_per_s:,.0f} tokens/s"]
    if getattr(stats, "tflops", None) is not None:
        parts.append(f"{stats.tflops:.3g} TFLOP/s")
    if getattr(stats, "mfu", None) is not None:
        parts.append(f"MFU {stats.mfu:.1f}%")
    per_rank = getattr(stats, "peak_mem_gb_per_rank", None)
    if per_rank:
        low, high = min(per_rank), max(per_rank)
        parts.append(f"peak {high:.2f} GiB" if len(per_rank) == 1 else f"peak {low:.2f}-{high:.2f} GiB")
    return " | ".join(parts)


def wants_bar(launcher: str, stream: TextIO | None = None) -> bool:
    """A bar only for a process started alone whose output is an interactive terminal (not TERM=dumb): launchers
    interleave other ranks' output with it or redirect it, and escape codes must not land in logs."""
    stream = sys.stdout if stream is None else stream
    term = overrides.get_str("TERM", "")
    return launcher == "single" and stream.isatty() and term not in ("", "dumb")


class ProgressReporter:
    """One line per logged iteration; where `wants_bar`, also a transient bar below the lines (gone when training
    ends, so the terminal keeps only the lines). Lines are never folded at the terminal's width."""

    def __init__(self, total: int, enabled: bool, start: int = 0, launcher: str = "single",
                 console: Any = None) -> None:
        self.total, self.enabled, self.start, self.launcher = total, enabled, start, launcher
        self.console = console  # a rich Console (None: rich's own, on stdout)
        self.progress = None
        self.task = None

    def __enter__(self) -> ProgressReporter:
        if self.enabled and wants_bar(self.launcher):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), transient=True, console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, stats: Any) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=stats.iteration)
            self.progress.console.print(format_stats(stats, self.total), soft_wrap=True, highlight=False,
                                        markup=False)
        else:
            print(format_stats(stats, self.total), flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
