"""Spans of work per stream, recorded with CUDA events (host clock on the CPU), for timeline pictures.

The engine wraps each action in `timeline.span(lane, label, stream)`. Recording costs two events per span and
never synchronizes; timestamps are read after the iteration (`collect()`), gathered to rank 0 (`gather()`) and
drawn by observe/timeline_draw.py (PNG and Chrome trace). observe/timeline_check.py checks that the spans respect
the pipeline's dependencies.

Label vocabulary (what the drawing and the checker understand): "F<mb>" forward and "B<mb>" backward of
microbatch mb on a compute lane ("compute", or "compute<i>" for local stage i in single-GPU mode); labels that
start with "send"/"recv"/"copy" are transfers, with "allreduce" gradient reductions, with "opt"/"step" the
optimizer; anything else is drawn as "other".

Ranks' clocks are aligned through the host wall clock: after the iteration, `collect()` records one more event on
the origin's stream, waits for it and reads the host clock, which dates the origin event in host time to within
the wake-up latency of an event wait (microseconds). Across hosts the alignment is only as good as NTP.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class Span:
    rank: int
    lane: str  # stream role: compute, p2p, allreduce, h2d, d2h
    label: str  # e.g. F3, B3, send act 3, allreduce bucket 0
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    def as_tuple(self) -> tuple[int, str, str, float, float]:
        """A plain tuple, cheap to pickle for gather_object."""
        return (self.rank, self.lane, self.label, self.start_ms, self.end_ms)


class Timeline:
    """Records spans when enabled; a disabled timeline costs nothing."""

    def __init__(self, rank: int, enabled: bool = False) -> None:
        self.rank = rank
        self.enabled = enabled
        self._open: list[tuple[str, str, Any, Any]] = []
        self._origin: Any = None
        self._origin_stream: torch.cuda.Stream | None = None
        #: host wall-clock time (ms since the epoch) of the origin, set by collect()
        self.origin_host_ms: float | None = None

    def start_iteration(self, stream: torch.cuda.Stream | None) -> None:
        """Mark time zero of the recorded iteration (an event on `stream`)."""
        self._open.clear()
        if not self.enabled:
            return
        self._origin_stream = stream
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

    def _date_origin(self) -> None:
        """Date the origin in host wall-clock ms (synchronizes; only after the iteration)."""
        if isinstance(self._origin, float):
            self.origin_host_ms = (time.time() - time.perf_counter() + self._origin) * 1e3
            return
        ref = torch.cuda.Event(enable_timing=True)
        ref.record(self._origin_stream)
        ref.synchronize()
        now_ms = time.time() * 1e3
        self.origin_host_ms = now_ms - self._origin.elapsed_time(ref)

    def collect(self) -> list[Span]:
        """Resolve recorded marks into spans, in ms after the origin (synchronizes: call after the iteration,
        never inside it)."""
        if self._origin is None:
            return []
        spans = []
        for lane, label, begin, end in self._open:
            if isinstance(begin, float):
                spans.append(Span(self.rank, lane, label, (begin - self._origin) * 1e3, (end - self._origin) * 1e3))
            else:
                end.synchronize()
                spans.append(Span(self.rank, lane, label, self._origin.elapsed_time(begin),
                                  self._origin.elapsed_time(end)))
        self._date_origin()
        return spans

    def gather(self, dst: int = 0, group: dist.ProcessGroup | None = None) -> dict[int, list[Span]] | None:
        """Collect this rank's spans and gather every rank's to `dst` (collective over `group`, default the
        world). On `dst`: {rank: spans} on one time axis (ms after the earliest origin); elsewhere None."""
        return gather_spans(self.collect(), self.origin_host_ms or 0.0, self.rank, dst=dst, group=group)


def gather_spans(spans: list[Span], origin_host_ms: float, rank: int, dst: int = 0,
                 group: dist.ProcessGroup | None = None) -> dict[int, list[Span]] | None:
    """Gather (origin, spans) of every rank to `dst` and shift each rank's spans onto a common axis whose zero
    is the earliest origin. Without a process group, returns this rank's spans alone."""
    payload = (rank, origin_host_ms, [s.as_tuple() for s in spans])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        me = dist.get_rank()
        # gather_object needs CPU pickles moved through the backend; on NCCL it uses the current device.
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if me == dst else None
        dist.gather_object(payload, gathered, dst=dst, group=group)
        if me != dst:
            return None
        payloads = gathered
    else:
        payloads = [payload]
    return merge_payloads(payloads)


def merge_payloads(payloads: list[tuple[int, float, list[tuple[int, str, str, float, float]]]]
                   ) -> dict[int, list[Span]]:
    """[(rank, origin in host ms, span tuples relative to that origin)] -> {rank: spans} on one axis whose zero is
    the earliest origin."""
    zero = min(p[1] for p in payloads)
    out: dict[int, list[Span]] = {}
    for r, origin, tuples in payloads:
        shift = origin - zero
        out[r] = [Span(t[0], t[1], t[2], t[3] + shift, t[4] + shift) for t in tuples]
    return dict(sorted(out.items()))
