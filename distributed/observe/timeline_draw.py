"""Draw a gathered timeline: a PNG (one lane per stream per rank) and a Chrome trace JSON (Perfetto).

Input is what `Timeline.gather()` returns on rank 0: {rank: [Span]} on one time axis in ms. matplotlib is imported
only when a PNG is drawn; without it the PNG is skipped with a warning and the trace is still written.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from peerline.distributed.observe.timeline import Span

log = logging.getLogger(__name__)

# the engine labels a transfer step with its schedule actions, e.g. "SA3" or "SA3+RG1" (pipeline/schedule.py)
_P2P_ACTION = re.compile(r"^(SA|RA|SG|RG)\d")

LANE_ORDER = ("compute", "p2p", "allreduce", "h2d", "d2h")
KIND_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "copy": "#55a868",
    "allreduce": "#c44e52",
    "optimizer": "#8172b3",
    "other": "#937860",
}


def span_kind(label: str) -> str:
    """Colour class of a span from its label (vocabulary in observe/timeline.py)."""
    low = label.lower()
    if low[:1] == "f" and low[1:2].isdigit():
        return "forward"
    if low[:1] == "b" and low[1:2].isdigit():
        return "backward"
    if low.startswith(("send", "recv", "copy", "h2d", "d2h")) or _P2P_ACTION.match(label):
        return "copy"
    if low.startswith(("allreduce", "all-reduce", "all_reduce", "bucket")):
        return "allreduce"
    if low.startswith(("opt", "step", "adam")):
        return "optimizer"
    return "other"


def _lane_key(lane: str) -> tuple[int, str]:
    for i, base in enumerate(LANE_ORDER):
        if lane.startswith(base):
            return (i, lane)
    return (len(LANE_ORDER), lane)


def lanes(spans_by_rank: dict[int, list[Span]]) -> list[tuple[int, str]]:
    """(rank, lane) rows in drawing order: ranks ascending, lanes compute, p2p, allreduce, h2d, d2h, others."""
    rows = []
    for rank in sorted(spans_by_rank):
        for lane in sorted({s.lane for s in spans_by_rank[rank]}, key=_lane_key):
            rows.append((rank, lane))
    return rows


def idle_fraction(spans: list[Span], start_ms: float, end_ms: float) -> float:
    """Share of [start_ms, end_ms] covered by none of `spans`: on a compute lane, the bubbles (and any exposed
    communication the stream waited for)."""
    if end_ms <= start_ms:
        return 0.0
    busy, cursor = 0.0, start_ms
    for s in sorted(spans, key=lambda s: s.start_ms):
        a, b = max(s.start_ms, cursor), min(s.end_ms, end_ms)
        if b > a:
            busy += b - a
            cursor = b
    return 1.0 - busy / (end_ms - start_ms)


def chrome_trace(spans_by_rank: dict[int, list[Span]]) -> dict:
    """Chrome trace events: pid = rank, tid = lane (named by metadata events), times in microseconds."""
    events: list[dict] = []
    for rank in sorted(spans_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        rank_lanes = sorted({s.lane for s in spans_by_rank[rank]}, key=_lane_key)
        tid_of = {lane: i + 1 for i, lane in enumerate(rank_lanes)}
        for lane, tid in tid_of.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in sorted(spans_by_rank[rank], key=lambda s: s.start_ms):
            events.append({"name": s.label, "cat": span_kind(s.label), "ph": "X", "pid": rank, "tid": tid_of[s.lane],
                           "ts": round(s.start_ms * 1e3, 3), "dur": round(max(s.duration_ms, 0.0) * 1e3, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans_by_rank: dict[int, list[Span]], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans_by_rank)))
    return path


def draw_png(spans_by_rank: dict[int, list[Span]], path: Path, title: str | None = None) -> Path | None:
    """One horizontal lane per (rank, stream); bars coloured by kind, labelled with microbatch where they fit.
    Gaps on a compute lane are the bubbles; each compute lane is labelled with its idle share of the iteration.
    Returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the machines that run this
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        log.warning("matplotlib is not installed: no PNG timeline (pip install 'peerline[plot]')")
        return None
    rows = lanes(spans_by_rank)
    end = max((s.end_ms for spans in spans_by_rank.values() for s in spans), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 0.45 * max(len(rows), 2) + 1.4))
    for y, (rank, lane) in enumerate(rows):
        for s in spans_by_rank[rank]:
            if s.lane != lane:
                continue
            width = max(s.duration_ms, end * 1e-4)
            ax.barh(y, width, left=s.start_ms, height=0.8, color=KIND_COLOURS[span_kind(s.label)],
                    edgecolor="black", linewidth=0.3)
            if width > end / 60:
                ax.text(s.start_ms + width / 2, y, s.label, ha="center", va="center", fontsize=6, clip_on=True)
        if lane.startswith("compute"):
            mine = [s for s in spans_by_rank[rank] if s.lane == lane]
            ax.text(end * 1.005, y, f"idle {idle_fraction(mine, 0.0, end):.0%}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.07)
    ax.set_xlabel("ms since the iteration started")
    used = {span_kind(s.label) for spans in spans_by_rank.values() for s in spans}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items() if k in used],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(used) or 1, frameon=False)
    ax.set_title(title or "one iteration, one lane per stream per rank (gaps on compute lanes are bubbles)",
                 fontsize=9, loc="left")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_timeline(spans_by_rank: dict[int, list[Span]] | list[list[Span]], path_stem: str | Path,
                   title: str | None = None) -> list[Path]:
    """Write <stem>.png (when matplotlib is available) and <stem>.json (Chrome trace); returns the paths.

    `spans_by_rank` is what `Timeline.gather()` returns on rank 0 (a list indexed by rank is accepted too, but
    only gather() puts the ranks on one clock)."""
    if isinstance(spans_by_rank, list):
        spans_by_rank = {rank: list(spans or []) for rank, spans in enumerate(spans_by_rank)}
    stem = Path(path_stem)
    if stem.suffix in (".png", ".json"):
        stem = stem.with_suffix("")
    out = [write_chrome_trace(spans_by_rank, stem.with_name(stem.name + ".json"))]
    png = draw_png(spans_by_rank, stem.with_name(stem.name + ".png"), title)
    if png is not None:
        out.insert(0, png)
    return out
