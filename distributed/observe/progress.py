"""What rank 0 shows while training: a rich progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import Any


def format_stats(stats: Any, total: int) -> str:
    """The progress line of one logged iteration."""
    return (f"iter {stats.iteration}/{total} | loss {stats.loss:.6f} | {stats.ms:.2f} ms/iter | "
            f"{stats.tokens_per_s:,.0f} tokens/s | peak {stats.peak_mem_gb:.2f} GiB")


class ProgressReporter:
    """Rich progress bar when stdout is a terminal, one plain line per logged iteration otherwise."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.total, self.enabled, self.start = total, enabled, start
        self.progress = None
        self.task = None

    def __enter__(self) -> ProgressReporter:
        if self.enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.description}"))
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, stats: Any) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.update(self.task, completed=stats.iteration,
                                 description=f"loss {stats.loss:.5f} | {stats.ms:.1f} ms")
            self.progress.console.print(format_stats(stats, self.total))
        else:
            print(format_stats(stats, self.total), flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
