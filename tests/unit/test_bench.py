"""launch/bench.py and benchkit: suite names, usage errors, not-available suites, failing suites, records."""

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from peerline.bench import benchkit, suites
from peerline.bench.benchkit import BenchContext, Record
from peerline.launch import bench

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_resolve_suites_all_and_unknown():
    assert bench.resolve_suites(["all"]) == list(suites.SUITES)
    assert bench.resolve_suites(["pipeline", "kernels", "pipeline"]) == ["pipeline", "kernels"]
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        bench.resolve_suites(["pipeline", "nope"])


def test_bad_suite_name_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "bench.py"), "pipeline", "warp-drive"],
                          capture_output=True, text=True, timeout=60, env={"PEERLINE_DEVICE": "cpu", "PATH": ""})
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["peerline-bench: error: unknown suite 'warp-drive'; choose from kernels, p2p, allreduce, "
                     "batch_streams, graph, single, pipeline or all"], proc.stderr


def test_missing_suite_module_is_not_available(monkeypatch):
    monkeypatch.setitem(suites.SUITES, "ghost", "ghost_suite_that_does_not_exist")
    module, why = suites.load_suite("ghost")
    assert module is None and "not written yet" in why
    module, why = suites.load_suite("pipeline")
    assert module is not None and why == ""


def _fake_suite(name: str, run) -> None:
    mod = types.ModuleType(f"peerline.bench.suites.{name}")
    mod.run = run
    sys.modules[mod.__name__] = mod


def test_main_runs_suites_reports_failures_and_writes_valid_json(monkeypatch, tmp_path):
    def good(args, ctx):
        ctx.step("measuring")
        ctx.record(Record("good", "case a", "GB/s", 2.0, 1.0, "anchor", sizes={"n": 1}))
        ctx.record(Record("good", "case b", "ms", 0.0, 1.0, "anchor", higher_is_better=False))  # ratio NaN
        ctx.note("a note")

    def bad(args, ctx):
        raise RuntimeError("boom")

    _fake_suite("fake_good", good)
    _fake_suite("fake_bad", bad)
    monkeypatch.setattr(suites, "SUITES", {"good": "fake_good", "bad": "fake_bad", "ghost": "no_such_module"})
    monkeypatch.setattr(bench, "SUITES", suites.SUITES)
    try:
        rc = bench.main(["all", "--out", str(tmp_path), "--device", "cpu"])
    finally:
        for n in ("fake_good", "fake_bad"):
            sys.modules.pop(f"peerline.bench.suites.{n}", None)
    assert rc == 1  # one suite failed; the others ran
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    recs = [json.loads(ln) for ln in lines]  # strict JSON: NaN is written as null
    assert [r["case"] for r in recs] == ["case a", "case b"]
    assert recs[0]["ratio"] == 2.0 and recs[1]["ratio"] is None
    for key in ("suite", "case", "sizes", "peerline", "anchor", "ratio", "card", "torch", "date"):
        assert key in recs[0]
    md = (tmp_path / "results.md").read_text()
    assert "| good | case a | GB/s | 2 | 1 | anchor | 2.000 |" in md
    assert "suite bad: failed: RuntimeError: boom" in md and "suite ghost: not available" in md
    assert "a note" in md


def test_time_blocks_on_cpu_without_process_group():
    calls = []
    t = benchkit.time_blocks(lambda n: calls.append(n), iters=3, reps=4, warmup=2, device=torch.device("cpu"))
    assert calls == [3] * 6 and t.reps == 4 and math.isfinite(t.median_ms) and t.median_ms >= 0


def test_record_ratio_direction():
    assert Record("s", "c", "GB/s", 3.0, 1.5, "a").ratio == pytest.approx(2.0)
    assert Record("s", "c", "ms", 1.0, 4.0, "a", higher_is_better=False).ratio == pytest.approx(4.0)


def test_write_only_on_rank_zero(tmp_path):
    ctx = BenchContext(out_dir=tmp_path / "x", device=torch.device("cpu"), is_writer=False)
    ctx.record(Record("s", "c", "GB/s", 1.0, 1.0, "a"))
    assert ctx.write() is None and not (tmp_path / "x").exists()


def test_parser_carries_the_suites_own_flags():
    args = bench.build_parser().parse_args(["pipeline", "graph", "--schedules", "1f1b", "--dp", "2",
                                            "--pipeline-configs", "launch", "--variants", "torch,graph",
                                            "--graph-microbatches", "4", "--reps", "3"])
    assert args.schedules == ["1f1b"] and args.dp == 2 and args.pipeline_configs == ["launch"]
    assert args.variants == ["torch", "graph"] and args.graph_microbatches == 4 and args.reps == 3


def test_pipeline_suite_rejects_unknown_names_before_running(tmp_path):
    import torch.distributed as dist

    from peerline.bench.suites import pipeline

    args = bench.build_parser().parse_args(["pipeline", "--schedules", "zigzag"])
    ctx = BenchContext(out_dir=tmp_path, device=torch.device("cpu"), quick=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
            pipeline.run(args, ctx)
    finally:
        dist.destroy_process_group()
    assert ctx.records == []
