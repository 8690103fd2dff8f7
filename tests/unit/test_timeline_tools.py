"""Timeline spans: recording on the CPU, gathering without a process group, the consistency checker, and the
PNG / Chrome trace writers."""

import json
import time

import pytest

from peerline.bench.ideal import stage_order
from peerline.distributed.observe import timeline_check, timeline_draw
from peerline.distributed.observe.timeline import Span, Timeline

pytestmark = pytest.mark.timeout(60)


def synthetic_pipeline(schedule: str, pp: int, m: int, f: float = 1.0, b: float = 2.0, gap: float = 0.1
                       ) -> dict[int, list[Span]]:
    """Spans of an ideal run of `schedule` (each action as early as its dependencies allow, plus a transfer gap)."""
    done: dict[tuple[str, int, int], float] = {}
    spans: dict[int, list[Span]] = {s: [] for s in range(pp)}
    orders = [stage_order(schedule, s, pp, m) for s in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, mb = orders[s][pos[s]]
                deps = ([("F", mb, s - 1)] if s > 0 else []) if kind == "F" else \
                    [("F", mb, s)] + ([("B", mb, s + 1)] if s < pp - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] + (gap if d[2] != s else 0.0) for d in deps])
                end = start + (f if kind == "F" else b)
                spans[s].append(Span(s, "compute", f"{kind}{mb}", start, end))
                if (kind == "F" and s < pp - 1) or (kind == "B" and s > 0):
                    spans[s].append(Span(s, "p2p", f"send {'act' if kind == 'F' else 'grad'} {mb}", end, end + gap))
                done[(kind, mb, s)] = end
                free[s] = end
                pos[s] += 1
    return spans


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checker_accepts_a_consistent_pipeline(schedule):
    spans = synthetic_pipeline(schedule, pp=3, m=4)
    assert timeline_check.check_spans(spans, pp=3) == []


def test_checker_catches_each_kind_of_violation():
    spans = synthetic_pipeline("1f1b", pp=2, m=3)
    # Stage 1 starts F1 before stage 0 has finished it.
    f1_s0 = next(s for s in spans[0] if s.label == "F1")
    f1_s1 = next(s for s in spans[1] if s.label == "F1")
    f1_s1.start_ms = f1_s0.end_ms - 0.5
    errors = timeline_check.check_spans(spans, pp=2, tol_ms=0.0)
    assert any("F1 stage 1" in e for e in errors), errors

    spans = synthetic_pipeline("gpipe", pp=2, m=2)
    b0_s0 = next(s for s in spans[0] if s.label == "B0")
    b0_s1 = next(s for s in spans[1] if s.label == "B0")
    b0_s0.start_ms, b0_s0.end_ms = b0_s1.start_ms, b0_s1.start_ms + 0.01
    assert any("B0 stage 0" in e for e in timeline_check.check_spans(spans, pp=2))

    spans = synthetic_pipeline("gpipe", pp=2, m=2)
    spans[1] = [s for s in spans[1] if s.label != "F1"]
    assert any("has no F1" in e for e in timeline_check.check_spans(spans, pp=2))

    overlapping = {0: [Span(0, "compute", "F0", 0, 2), Span(0, "compute", "F1", 1, 3)]}
    assert any("inside" in e for e in timeline_check.check_spans(overlapping, pp=1))


def test_checker_places_replicas_and_local_stages():
    # dp = 2: ranks 2, 3 are replica 1; their F0 may start before replica 0's stage 1 is done.
    spans = synthetic_pipeline("gpipe", pp=2, m=2)
    shifted = {r + 2: [Span(r + 2, s.lane, s.label, s.start_ms - 0.5, s.end_ms - 0.5) for s in v]
               for r, v in spans.items()}
    assert timeline_check.check_spans({**spans, **shifted}, pp=2) == []
    # One rank with two local stages on lanes compute0 / compute1.
    one = [Span(0, "compute0" if s.rank == 0 else "compute1", s.label, s.start_ms, s.end_ms)
           for r, v in spans.items() for s in v if s.lane == "compute"]
    assert timeline_check.check_spans({0: one}, pp=1, stages_per_rank=2) == []


def test_cpu_timeline_records_and_gathers_alone():
    tl = Timeline(rank=0, enabled=True)
    tl.start_iteration(None)
    with tl.span("compute", "F0", None):
        time.sleep(0.002)
    with tl.span("p2p", "send act 0", None):
        pass
    gathered = tl.gather()
    assert list(gathered) == [0]
    f0, send = gathered[0]
    assert f0.label == "F0" and f0.duration_ms >= 1.5
    assert send.start_ms >= f0.end_ms
    assert tl.origin_host_ms is not None and abs(tl.origin_host_ms - time.time() * 1e3) < 5_000


def test_merge_puts_ranks_on_one_clock():
    from peerline.distributed.observe.timeline import merge_payloads

    # rank 1 started its iteration 2.5 ms after rank 0 (host clock); its spans shift by 2.5 ms.
    merged = merge_payloads([(1, 1000.0 + 2.5, [(1, "compute", "F0", 0.5, 1.5)]),
                             (0, 1000.0, [(0, "compute", "F0", 0.0, 1.0), (0, "p2p", "SA0", 1.0, 2.0)])])
    assert list(merged) == [0, 1]
    assert merged[0][1].label == "SA0" and merged[0][1].start_ms == pytest.approx(1.0)
    assert (merged[1][0].start_ms, merged[1][0].end_ms) == (pytest.approx(3.0), pytest.approx(4.0))


def test_disabled_timeline_records_nothing():
    tl = Timeline(rank=0)
    tl.start_iteration(None)
    with tl.span("compute", "F0", None):
        pass
    assert tl.collect() == []


def test_chrome_trace_and_png(tmp_path):
    spans = synthetic_pipeline("1f1b", pp=2, m=4)
    spans[0].append(Span(0, "allreduce", "allreduce bucket 0", 10.0, 11.0))
    paths = timeline_draw.write_timeline(spans, tmp_path / "it")
    names = sorted(p.name for p in paths)
    assert names == ["it.json", "it.png"]
    png = tmp_path / "it.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    trace = json.loads((tmp_path / "it.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(v) for v in spans.values())
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads[(0, 1)] == "compute" and threads[(0, 2)] == "p2p" and threads[(0, 3)] == "allreduce"
    f0 = next(e for e in xs if e["pid"] == 1 and e["name"] == "F0")
    assert f0["ts"] == pytest.approx(1100.0) and f0["dur"] == pytest.approx(1000.0) and f0["cat"] == "forward"


def test_idle_fraction_counts_gaps_once():
    spans = [Span(0, "compute", "F0", 1.0, 3.0), Span(0, "compute", "F1", 2.0, 4.0), Span(0, "compute", "B0", 6, 8)]
    assert timeline_draw.idle_fraction(spans, 0.0, 10.0) == pytest.approx(0.5)  # busy 1-4 and 6-8
    assert timeline_draw.idle_fraction([], 0.0, 10.0) == 1.0


def test_span_kinds():
    assert [timeline_draw.span_kind(x) for x in ("F3", "B12", "send act 1", "allreduce bucket 0", "optimizer",
                                                 "Fx", "SA3+RG1")] == ["forward", "backward", "copy", "allreduce",
                                                            "optimizer", "other", "copy"]
