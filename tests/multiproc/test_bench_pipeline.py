"""CPU smoke tests of launch/bench.py's pipeline suite (gloo): 2 ranks (pp=2) and 4 ranks (pp=2 x dp=2, the anchor
with DDP), forked as torchrun would start them (tests/forkjob.py), a single process, and a stuck rank under the real
torchrun. The JSON must validate, ratios must be finite, and the anchor (torch.distributed.pipelining) must compute
the same losses as peerline from the same weights and data, every candidate schedule of it: the two runs only share
the model definition and the data recipe, so equal losses check the anchor's wiring. The `best` record names
peerline's and torch's fastest."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerline.bench.ideal import PLACED
from peerline.bench.suites.torch_schedules import TORCH_SCHEDULES
from tests import forkjob
from tests.helpers import forkrun_cmd, run_command

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
BENCH = forkjob.BENCH


def run_bench(nproc: int, args: list[str], out: Path, suites: tuple[str, ...] = ("pipeline",)
              ) -> subprocess.CompletedProcess:
    """The bench's suites as the job torchrun would start (one rank: a plain process), its ranks forked from the
    test fork server (run_command): the subject is the bench, not the launcher. The children the bench starts
    itself (its one-GPU parts) are real processes."""
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    launcher = [sys.executable] if nproc == 1 else forkrun_cmd(nproc)
    return run_command([*launcher, BENCH, *suites, "--quick", "--out", str(out), *args], out.parent, env, timeout=200)


def records(out: Path, suite: str = "pipeline") -> list[dict]:
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["suite"] == suite]
    for r in recs:
        assert r["card"] == "cpu"
        for key in ("case", "sizes", "peerline", "anchor", "ratio", "torch", "date"):
            assert key in r, key
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["peerline"] > 0 and r["anchor"] > 0
    return recs


def check_best(recs: list[dict], anchor_candidates: set[str]) -> None:
    """The `quick best` record: peerline's fastest against torch's fastest of exactly `anchor_candidates`, every
    candidate with peerline's losses."""
    (best,) = [r for r in recs if r["case"] == "quick best"]
    ex = best["extra"]
    assert set(ex["anchor_candidates"]) == anchor_candidates, ex["anchor_candidates"]
    fastest = min(ex["anchor_candidates"], key=lambda k: ex["anchor_candidates"][k]["ms_per_iter"])
    assert best["anchor_name"].startswith(f"torch.distributed.pipelining {fastest}"), best["anchor_name"]
    assert ex["peerline_best"] == min(ex["peerline_candidates"], key=ex["peerline_candidates"].get)
    losses = next(r["extra"]["losses"] for r in recs if r["metric"] == "tokens/s" and r is not best)
    for name, cand in ex["anchor_candidates"].items():
        assert max(abs(a - b) for a, b in zip(cand["losses"], losses, strict=True)) <= 1e-5 * abs(losses[0]), name


def check_losses(recs: list[dict]) -> None:
    vs_torch = [r for r in recs if r["metric"] == "tokens/s" and r["case"] != "quick best"]
    assert vs_torch
    for r in vs_torch:
        ex = r["extra"]
        assert len(ex["losses"]) == 2 and len(ex["anchor_losses"]) == 2
        assert ex["max_loss_diff"] <= 1e-5 * abs(ex["anchor_losses"][0]), (r["case"], ex["losses"],
                                                                            ex["anchor_losses"])
        if r["sizes"]["schedule"] in PLACED:  # stages as streams of a rank: no per-stage bound measured
            continue
        assert math.isfinite(ex["ideal"]["bound_ms"]) and ex["ideal"]["bound_ms"] > 0


def test_pipeline_suite_two_ranks_with_timeline(tmp_path):
    out = tmp_path / "pp2"
    proc = run_bench(2, ["--pipeline-timeline", "--schedules", "gpipe,1f1b"], out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(out)
    cases = {r["case"] for r in recs}
    for schedule in ("gpipe", "1f1b"):
        assert f"quick {schedule} eager" in cases
        assert f"quick {schedule} eager vs ideal" in cases
    assert all(r["sizes"]["pp"] == 2 for r in recs)
    check_losses(recs)
    md = (out / "results.md").read_text()
    assert "| pipeline | quick 1f1b eager | tokens/s |" in md
    for schedule in ("gpipe", "1f1b"):
        assert (out / f"timeline-quick-{schedule}.png").stat().st_size > 5_000
        trace = json.loads((out / f"timeline-quick-{schedule}.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
        assert f"timeline quick {schedule}" in md
    assert md.count(", consistent") == 2, md
    check_best(recs, {f"{s} fp32" for s in TORCH_SCHEDULES})  # 4 layers, M=4 at pp=2: every torch schedule applies
    # the bubble-free time: the whole model in a fresh one-rank process, the same data and weights, so the same losses
    (free,) = [r for r in recs if r["case"] == "quick best vs bubble-free"]
    assert free["extra"]["peerline_best"] in {"gpipe eager", "1f1b eager"} and not free["extra"]["one_gpu_graph"]
    assert free["anchor"] == pytest.approx(free["extra"]["one_gpu_ms"] / 2)
    # GPipe and 1F1B with balanced stages idle (P - 1) / (M + P - 1) of the time: the ceiling is M / (M + P - 1)
    assert free["extra"]["schedule_ceiling"] == pytest.approx(4 / 5)
    assert "at M=4 reaches at most 0.800 of the bubble-free time" in md
    for a, b in zip(free["extra"]["one_gpu_losses"], free["extra"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (free["extra"]["one_gpu_losses"], free["extra"]["losses"])


def test_pipeline_suite_times_each_zb_order_against_one_anchor(tmp_path):
    """--pipeline-zb-orders: zbv once per order, each named by it and recorded against the same anchor, with the
    same losses (the orders change when each compute runs, not what it computes)."""
    out = tmp_path / "orders"
    proc = run_bench(2, ["--schedules", "zbv", "--variants", "torch,eager", "--pipeline-anchor-schedules", "1f1b",
                         "--pipeline-zb-orders", "list,paper", "--no-pipeline-bubble-free"], out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_case = {r["case"]: r for r in records(out)}
    listed, paper = by_case["quick zbv eager zb-order-list"], by_case["quick zbv eager"]  # paper: the run's default
    assert listed["extra"]["zb_order"] == "list" and paper["extra"]["zb_order"] == "paper"
    assert listed["anchor"] == paper["anchor"] and listed["anchor_name"] == paper["anchor_name"]
    for a, b in zip(paper["extra"]["losses"], listed["extra"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (paper["extra"]["losses"], listed["extra"]["losses"])
    check_losses(list(by_case.values()))


def test_pipeline_suite_pp2_dp2_anchor_with_ddp(tmp_path):
    out = tmp_path / "pp2dp2"
    proc = run_bench(4, ["--dp", "2", "--schedules", "1f1b"], out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(out)
    assert {r["case"] for r in recs} == {"quick 1f1b eager", "quick 1f1b eager vs ideal", "quick best",
                                         "quick best vs bubble-free"}
    assert recs[0]["sizes"]["dp"] == 2 and recs[0]["anchor_name"].endswith("+ DDP")
    check_losses(recs)
    check_best(recs, {"1f1b fp32", "gpipe fp32"})  # DDP: the schedules of one stage per rank


def test_pipeline_and_graph_suites_single_process(tmp_path):
    out = tmp_path / "one"
    proc = run_bench(1, ["--schedules", "gpipe", "--pipeline-anchor-schedules", "gpipe,zbv",
                         "--pipeline-precisions", "master,autocast,bf16"], out, suites=("pipeline", "graph"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(out)
    assert recs and all(r["sizes"]["pp"] == 1 for r in recs)
    # each recipe a case of its own (fp32 on the CPU: autocast is fp32 weights without autocast, the same losses);
    # bf16 keeps bf16 weights and the quick shape is fp32: left out with a note
    by_case = {r["case"]: r for r in recs}
    assert by_case["quick gpipe eager"]["extra"]["precision"] == "master"
    assert by_case["quick gpipe eager autocast"]["extra"]["precision"] == "autocast"
    assert not any("bf16" in c for c in by_case)
    assert "--precision bf16 keeps bf16 weights, and this shape is fp32; not run" in (out / "results.md").read_text()
    check_losses(recs)
    check_best(recs, {"gpipe fp32"})  # the flag's choice; ZBV needs two pipeline ranks (noted, not tried)
    assert "ScheduleZBVZeroBubble not tried: needs 2 or more pipeline ranks" in (out / "results.md").read_text()
    # graph suite on the CPU: eager peerline vs eager torch from the same weights and data
    (g,) = records(out, "graph")
    assert g["case"] == "quick M=1 peerline eager vs torch eager"
    assert g["extra"]["max_loss_diff"] <= 1e-5 * g["extra"]["anchor_losses"][0]


@pytest.mark.parametrize("stuck", [0, 1])
def test_a_stuck_rank_ends_the_bench_with_one_line_and_a_noted_failure(tmp_path, stuck):
    """A rank that stops inside a measurement (PEERLINE_FAULT hang) must not hang the bench: the job ends at the
    watchdog's deadline with a line naming the rank, and the failed variant is noted (rank 0: results.md;
    another rank: failed-rank<R>.txt beside it, since rank 0 may be ended first)."""
    out = tmp_path / "out"
    env_fault = {"PEERLINE_FAULT": f"hang:rank={stuck}:iter=3"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", BENCH, "pipeline",
         "--quick", "--deadline-s", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
        env=dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env_fault))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("peerline: error:")]
    assert lines and any(f"rank {stuck} (stage {stuck})" in ln for ln in lines), proc.stderr[-3000:]
    # Whichever rank's deadline passes first notes it (the two wait from about the same moment): rank 0 in
    # results.md, another rank in its own file.
    noted = "".join(f.read_text() for f in [out / "results.md", *sorted(out.glob("failed-rank*.txt"))] if f.exists())
    assert "FAILED pipeline quick" in noted and "the job ended here" in noted, noted
