"""peerline-bench (bench/main.py, bench/cli.py, launch/bench.py) and benchkit: suite names, usage errors, `--help`,
not-available and skipped suites, failing suites, records."""

import ast
import json
import math
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from peerline.bench import benchkit, cli, suites
from peerline.bench import main as bench
from peerline.bench.benchkit import BenchContext, Record

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_resolve_suites_all_and_unknown():
    assert cli.resolve_suites(["all"]) == list(suites.SUITES)
    assert cli.resolve_suites(["pipeline", "kernels", "pipeline"]) == ["pipeline", "kernels"]
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        cli.resolve_suites(["pipeline", "nope"])


def test_bad_suite_name_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "bench.py"), "pipeline", "warp-drive"],
                          capture_output=True, text=True, timeout=60, env={"PEERLINE_DEVICE": "cpu", "PATH": ""})
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    from peerline.bench.suites import SUITES

    assert lines == [f"peerline-bench: error: unknown suite 'warp-drive'; choose from {', '.join(SUITES)} or all"
                     ], proc.stderr


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


def test_skipped_suites_give_one_line_and_do_not_fail(monkeypatch, tmp_path, capsys):
    ran = []
    _fake_suite("fake_ok", lambda args, ctx: ran.append("ok"))
    _fake_suite("fake_skip", lambda args, ctx: ran.append("skip"))
    sys.modules["peerline.bench.suites.fake_skip"].skip_reason = lambda args, ctx: "needs a warp drive"
    monkeypatch.setattr(suites, "SUITES", {"ok": "fake_ok", "skip": "fake_skip", "pair": "fake_ok",
                                           "solo": "fake_ok"})
    monkeypatch.setattr(suites, "MIN_RANKS", {"pair": 2})
    monkeypatch.setattr(suites, "MAX_RANKS", {"solo": 0})
    try:
        rc = bench.main(["all", "--out", str(tmp_path), "--device", "cpu"])
    finally:
        for n in ("fake_ok", "fake_skip"):
            sys.modules.pop(f"peerline.bench.suites.{n}", None)
    assert rc == 0 and ran == ["ok"]
    out = capsys.readouterr().out
    assert "peerline-bench: skip: skipped: needs a warp drive\n" in out
    assert "peerline-bench: pair: skipped: needs 2 ranks (torchrun --nproc_per_node=2 launch/bench.py pair)" in out
    assert "peerline-bench: solo: skipped: runs on 0 rank" in out
    assert "suite skip: skipped: needs a warp drive" in (tmp_path / "results.md").read_text()


def test_rank_reasons_of_the_registry():
    assert suites.rank_reason("p2p", 1) == "needs 2 ranks (torchrun --nproc_per_node=2 launch/bench.py p2p)"
    assert suites.rank_reason("p2p", 2) is None and suites.rank_reason("single", 1) is None
    assert suites.rank_reason("single", 2) == "runs on 1 rank (python launch/bench.py single), this run has 2"
    assert set(suites.DESCRIPTIONS) == set(suites.SUITES)


def test_help_lists_every_suite_and_its_flags():
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "bench.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name in suites.SUITES:
        assert f"\n  {name} " in proc.stdout and f"{name} suite:" in proc.stdout, name
    assert "--pipeline-configs" in proc.stdout and "--ar-h2h-rounds" in proc.stdout


def test_usage_names_the_command_as_typed(monkeypatch):
    assert cli.usage_name("/venv/bin/peerline-bench") == "peerline-bench"
    assert cli.usage_name("launch/bench.py") == "launch/bench.py"
    assert cli.usage_name("/abs/launch/bench.py") == "python -m peerline.launch.bench"
    monkeypatch.setattr(sys, "argv", ["launch/bench.py", "--help"])
    assert cli.build_parser().format_usage().startswith("usage: launch/bench.py SUITE ")


def test_launch_script_is_a_thin_entry():
    tree = ast.parse((REPO / "launch" / "bench.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    from peerline.launch import bench as entry

    assert entry.main is bench.main


def test_time_blocks_on_cpu_without_process_group():
    calls = []
    t = benchkit.time_blocks(lambda n: calls.append(n), iters=3, reps=4, warmup=2, device=torch.device("cpu"))
    assert calls == [3] * 6 and t.reps == 4 and math.isfinite(t.median_ms) and t.median_ms >= 0
    # the CPU has no queue: the device's work ends with the host's, so the lead is about nothing
    assert t.host_lead_ms is not None and 0 <= t.host_lead_ms < 50


def test_time_blocks_interleaved_alternates_the_order_and_keeps_each_loops_samples():
    """Blocks of two loops in turn, the order reversed every other repetition (A B, B A, A B, ...); warm-up blocks
    dropped; each loop's timing from its own blocks (B sleeps 20 ms per iteration, far above A's no-op even on a
    loaded machine, and a sleep only overshoots)."""
    order: list[str] = []

    def a(n: int) -> None:
        order.append(f"a{n}")

    def b(n: int) -> None:
        order.append(f"b{n}")
        time.sleep(0.02 * n)

    ta, tb = benchkit.time_blocks_interleaved([a, b], iters=2, reps=3, warmup=1, device=torch.device("cpu"))
    assert order == ["a2", "b2", "b2", "a2", "a2", "b2", "b2", "a2"]
    assert ta.reps == tb.reps == 3 and tb.median_ms >= 20.0 > ta.median_ms


def test_slowest_rank_takes_the_longest_time_and_the_least_lead(monkeypatch: pytest.MonkeyPatch):
    """One all-reduce (MAX) gives both: the lead goes in negated. Ranks simulated: this one 4 ms with a lead of 9,
    the other 6 ms with a lead of 1."""
    other = torch.tensor([6.0, -1.0], dtype=torch.float64)
    monkeypatch.setattr(benchkit.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(benchkit.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(benchkit.dist, "all_reduce", lambda t, op, group=None: t.copy_(torch.maximum(t, other)))
    assert benchkit._slowest_rank(4.0, 9.0, torch.device("cpu"), None) == (6.0, 1.0)


def test_record_ratio_direction():
    assert Record("s", "c", "GB/s", 3.0, 1.5, "a").ratio == pytest.approx(2.0)
    assert Record("s", "c", "ms", 1.0, 4.0, "a", higher_is_better=False).ratio == pytest.approx(4.0)


def test_every_record_carries_the_hosts_load(tmp_path, monkeypatch):
    """A host-bound figure taken beside other work says so: the 1-minute load and the core count in `extra`;
    what a suite put there itself is kept."""
    monkeypatch.setattr(benchkit.os, "getloadavg", lambda: (7.254, 3.0, 1.0))
    ctx = BenchContext(out_dir=tmp_path, device=torch.device("cpu"), is_writer=False)
    rec = ctx.record(Record("s", "c", "ms", 1.0, 1.0, "a", extra={"host_cores": 2}))
    assert rec.extra["host_load_1min"] == 7.25 and rec.extra["host_cores"] == 2


def test_write_only_on_rank_zero(tmp_path):
    ctx = BenchContext(out_dir=tmp_path / "x", device=torch.device("cpu"), is_writer=False)
    ctx.record(Record("s", "c", "GB/s", 1.0, 1.0, "a"))
    assert ctx.write() is None and not (tmp_path / "x").exists()


def test_parser_carries_the_suites_own_flags():
    args = cli.build_parser().parse_args(["pipeline", "graph", "--schedules", "1f1b", "--dp", "2",
                                            "--pipeline-configs", "launch", "--variants", "torch,graph",
                                            "--graph-microbatches", "4", "--reps", "3"])
    assert args.schedules == ["1f1b"] and args.dp == 2 and args.pipeline_configs == ["launch"]
    assert args.variants == ["torch", "graph"] and args.graph_microbatches == 4 and args.reps == 3


@pytest.mark.parametrize("argv, message", [
    (["--schedules", "zigzag"], "unknown schedule 'zigzag'"),
    (["--variants", "torch,graph", "--pipeline-timeline"], "--pipeline-timeline draws an eager iteration"),
    (["--pipeline-precisions", "master,fp8"], "unknown precision 'fp8'"),
])
def test_pipeline_suite_rejects_bad_requests_before_running(tmp_path, argv: list[str], message: str):
    import torch.distributed as dist

    from peerline.bench.suites import pipeline

    args = cli.build_parser().parse_args(["pipeline", *argv])
    ctx = BenchContext(out_dir=tmp_path, device=torch.device("cpu"), quick=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            pipeline.run(args, ctx)
    finally:
        dist.destroy_process_group()
    assert ctx.records == []


def test_pipeline_precisions_keep_bf16_weights_to_bf16_shapes():
    """bf16 and compact keep bf16 weights: an fp32 shape runs the others and says which it left out; a variant's
    name carries its recipe unless it is master."""
    from peerline.bench.suites import pipeline

    notes: list[str] = []
    fp32, bf16 = pipeline.CONFIGS["quick"], pipeline.CONFIGS["compute"]
    assert pipeline._precisions_for(fp32, ["master", "bf16", "autocast", "compact"], notes.append) == [
        "master", "autocast"]
    assert len(notes) == 2 and "--precision bf16 keeps bf16 weights" in notes[0] and "compact" in notes[1]
    assert pipeline._precisions_for(bf16, ["bf16", "master"], notes.append) == ["bf16", "master"] and len(notes) == 2
    assert pipeline.variant_label(True, "master") == "graph"
    assert pipeline.variant_label(False, "bf16") == "eager bf16"


def test_a_zb_order_names_its_variant_and_sets_its_ceiling():
    """--pipeline-zb-orders: a variant's name carries its --zb-order unless it is the run's default (paper), and the
    bubble-free record's ceiling is that order's (zbv at pp=4, M=4: the paper's order fills later than the list
    order)."""
    from dataclasses import replace

    from peerline.bench.ideal import schedule_bubble
    from peerline.bench.suites import bubble_free, pipeline

    assert pipeline.variant_label(True, "bf16", "list") == "graph bf16 zb-order-list"
    assert pipeline.variant_label(True, "bf16", "paper") == pipeline.variant_label(True, "bf16") == "graph bf16"
    shape = replace(pipeline.CONFIGS["quick"], layers=8, microbatches=4)
    paper = bubble_free.schedule_ceiling("zbv graph bf16", shape, 4)
    listed = bubble_free.schedule_ceiling("zbv graph bf16 zb-order-list", shape, 4, "list")
    assert paper == pytest.approx(1 - schedule_bubble("zbv", 4, 4, 2, "paper"))
    assert listed == pytest.approx(1 - schedule_bubble("zbv", 4, 4, 2, "list")) and paper < listed
