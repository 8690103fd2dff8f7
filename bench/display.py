"""What the bench runs now: a rich progress bar on a terminal, plain lines otherwise (rank 0 only)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROG = "peerline-bench"


class Display:
    """One step per suite; `step` names the measurement that runs now."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self._progress: Any = None
        self._task: Any = None

    @contextmanager
    def running(self) -> Iterator[Display]:
        """The progress bar's lifetime (plain lines when stdout is not a terminal)."""
        if self.enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), transient=False) as progress:
                self._progress = progress
                self._task = progress.add_task("starting", total=self.total)
                yield self
            self._progress = None
        else:
            yield self

    def step(self, what: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, description=what)
        else:
            print(f"{PROG}: {what}", flush=True)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)
