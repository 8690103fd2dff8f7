"""Consistency of a gathered timeline: every span starts after the spans it depends on have ended.

Dependencies of the pipeline (stage s of replica r; mb a microbatch):
  F(mb) on stage s+1  after  F(mb) on stage s      (the activation must exist before it is consumed)
  B(mb) on stage s    after  B(mb) on stage s+1    (the gradient must exist before it is consumed)
  B(mb) on stage s    after  F(mb) on stage s      (backward needs the forward's saved tensors)
  spans of one lane of one rank do not overlap     (a stream runs its work in order)

Spans are recognised by label ("F3", "B3"; see observe/timeline.py). Cross-rank comparisons allow `tol_ms`
for the clock alignment error.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from peerline.distributed.observe.timeline import Span

_COMPUTE = re.compile(r"^(F|B)(\d+)\b")


def compute_kind(span: Span) -> tuple[str, int] | None:
    """("F"|"B", microbatch) for a forward/backward span on a compute lane, else None."""
    if not span.lane.startswith("compute"):
        return None
    m = _COMPUTE.match(span.label)
    return (m.group(1), int(m.group(2))) if m else None


def local_stage(span: Span) -> int:
    """Index of the local stage a compute span belongs to: "compute" -> 0, "compute<i>" -> i."""
    suffix = span.lane[len("compute"):]
    return int(suffix) if suffix.isdigit() else 0


def default_placement(pp: int, stages_per_rank: int = 1) -> Callable[[int, int], tuple[int, int]]:
    """(rank, local stage) -> (global stage, replica) for the mesh layout rank = replica * pp + stage, with
    `stages_per_rank` consecutive stages per rank."""
    def place(rank: int, local: int) -> tuple[int, int]:
        return (rank % pp) * stages_per_rank + local, rank // pp
    return place


def check_spans(spans_by_rank: dict[int, list[Span]], pp: int, stages_per_rank: int = 1, tol_ms: float = 0.05,
                placement: Callable[[int, int], tuple[int, int]] | None = None) -> list[str]:
    """Violations of the pipeline's dependencies, one line each (empty when the timeline is consistent)."""
    place = placement or default_placement(pp, stages_per_rank)
    n_stages = pp * stages_per_rank
    # (kind, mb, stage, replica) -> span
    work: dict[tuple[str, int, int, int], Span] = {}
    errors: list[str] = []
    for rank, spans in spans_by_rank.items():
        for sp in spans:
            if sp.end_ms < sp.start_ms:
                errors.append(f"rank {rank} {sp.lane} {sp.label}: ends before it starts")
            kind = compute_kind(sp)
            if kind is None:
                continue
            stage, replica = place(rank, local_stage(sp))
            key = (kind[0], kind[1], stage, replica)
            if key in work:
                errors.append(f"rank {rank}: {sp.label} of stage {stage} recorded twice")
            work[key] = sp
        errors += _overlaps(rank, spans)

    def after(later: Span, earlier: Span, why: str, tol: float) -> None:
        if later.start_ms + tol < earlier.end_ms:
            errors.append(f"{why}: starts at {later.start_ms:.3f} ms before its dependency ends at "
                          f"{earlier.end_ms:.3f} ms")

    for (kind, mb, stage, replica), sp in sorted(work.items(), key=lambda kv: kv[1].start_ms):
        if kind == "F" and stage > 0 and ("F", mb, stage - 1, replica) in work:
            prev = work[("F", mb, stage - 1, replica)]
            after(sp, prev, f"F{mb} stage {stage} (replica {replica}) vs F{mb} stage {stage - 1}",
                  0.0 if prev.rank == sp.rank else tol_ms)
        if kind == "B":
            if stage < n_stages - 1 and ("B", mb, stage + 1, replica) in work:
                nxt = work[("B", mb, stage + 1, replica)]
                after(sp, nxt, f"B{mb} stage {stage} (replica {replica}) vs B{mb} stage {stage + 1}",
                      0.0 if nxt.rank == sp.rank else tol_ms)
            if ("F", mb, stage, replica) in work:
                after(sp, work[("F", mb, stage, replica)], f"B{mb} stage {stage} (replica {replica}) vs its F{mb}",
                      0.0)
            else:
                errors.append(f"B{mb} stage {stage} (replica {replica}) has no F{mb}")
    return errors


def _overlaps(rank: int, spans: list[Span], eps_ms: float = 1e-6) -> list[str]:
    """Spans of one lane must be ordered: a stream runs one piece of work after another."""
    errors = []
    by_lane: dict[str, list[Span]] = {}
    for sp in spans:
        by_lane.setdefault(sp.lane, []).append(sp)
    for lane, items in by_lane.items():
        items.sort(key=lambda s: s.start_ms)
        for a, b in zip(items, items[1:], strict=False):
            if b.start_ms + eps_ms < a.end_ms:
                errors.append(f"rank {rank} lane {lane}: {b.label} starts at {b.start_ms:.3f} ms inside "
                              f"{a.label} ({a.start_ms:.3f}-{a.end_ms:.3f} ms)")
    return errors
