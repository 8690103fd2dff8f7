"""Spans of work per stream, recorded with CUDA events (host clock on the CPU), for timeline pictures.

The engine wraps each action in `timeline.span(lane, label, stream)`. Recording costs two events per span and
never synchronizes; timestamps are read after the iteration (`collect()`), gathered to rank 0 and drawn by
the timeline tools (PNG and Chrome trace).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Span:
    rank: int
    lane: str  # stream role: compute, p2p, allreduce, h2d, d2h
    label: str  # e.g. F3, B3, send act 3, allreduce bucket 0
    start_ms: float
    end_ms: float


class Timeline:
    """Records spans when enabled; a disabled timeline costs nothing."""

    def __init__(self, rank: int, enabled: bool = False) -> None:
        self.rank = rank
        self.enabled = enabled
        self._open: list[tuple[str, str, Any, Any]] = []
        self._origin: Any = None

    def start_iteration(self, stream: torch.cuda.Stream | None) -> None:
        """Mark time zero of the recorded iteration (an event on `stream`)."""
        self._open.clear()
        if not self.enabled:
            return
        self._origin = self._mark(stream)

    @staticmethod
    def _mark(stream: torch.cuda.Stream | None) -> Any:
        if stream is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    @contextlib.contextmanager
    def span(self, lane: str, label: str, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        begin = self._mark(stream)
        yield
        self._open.append((lane, label, begin, self._mark(stream)))

    def collect(self) -> list[Span]:
        """Resolve recorded marks into spans (synchronizes: call after the iteration, never inside it)."""
        spans = []
        for lane, label, begin, end in self._open:
            if isinstance(begin, float):
                spans.append(Span(self.rank, lane, label, (begin - self._origin) * 1e3, (end - self._origin) * 1e3))
            else:
                end.synchronize()
                spans.append(Span(self.rank, lane, label, self._origin.elapsed_time(begin),
                                  self._origin.elapsed_time(end)))
        return spans
