"""The kernels sweep's flow on the CPU: the GPU launches and timings replaced by torch references and a fake clock.
A plan that computes wrong results must be reported as such and never be the best, however fast."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from peerline.bench.kernel_tools import common
from peerline.bench.kernel_tools import sweep as ks
from peerline.bench.suites import kernels as suite
from peerline.kernels import compile as kc
from peerline.kernels import elementwise as ew

pytestmark = pytest.mark.timeout(120)


def _fake_fwd(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = F.gelu(x.double() + b.double())
    if ew.TUNING.get("stages") == 4:  # the "fast but wrong" plan
        y = y * 1.01
    return y.to(x.dtype)


def _fake_bwd(g: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = (x.float() + b).double()
    d = 0.5 * torch.special.erfc(-v / math.sqrt(2)) + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
    prod = g.double() * d
    return prod.to(x.dtype), prod.reshape(-1, x.shape[-1]).sum(0).float()


def _fake_time(calls: list, device: torch.device, reps: int) -> float:
    for c in calls:
        c()
    t = ew.TUNING
    if not t:  # anchors: torch eager and the copy
        return 1.0
    return 0.5 if t.get("stages") == 4 else (0.8 if t.get("direct") else 1.2)


def _fake_times(call_lists: list, device: torch.device, reps: int) -> list[float]:
    """common.graph_times on the fake clock: the first list is the sweep's torch anchor (timed beside each plan)."""
    for c in call_lists[0]:
        c()
    return [1.0] + [_fake_time(calls, device, reps) for calls in call_lists[1:]]


def test_sweep_flow_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ks, "SWEEP_CASES", (("bias_gelu_fwd fp32", "fwd", torch.float32, 0.125),
                                            ("bias_gelu_bwd bf16", "bwd", torch.bfloat16, 0.0625),
                                            ("residual_add fp32+fp32", "res", torch.float32, 0.125)))
    monkeypatch.setattr(ks, "CHECK_SHAPES", (((5, 101), 1), ((16, 256), 0)))
    monkeypatch.setattr(ew, "bias_gelu_forward", _fake_fwd)
    monkeypatch.setattr(ew, "bias_gelu_backward", _fake_bwd)
    monkeypatch.setattr(ew, "residual_add_forward", lambda x, y: x + y)
    monkeypatch.setattr(common, "graph_times", _fake_times)
    monkeypatch.setattr(kc, "warm_compile", lambda specs, dev, workers: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake")
    monkeypatch.setattr(ew, "_l2_bytes", lambda index: 0)
    rows = ks.run_sweep(tmp_path, torch.device("cpu"), budget_s=60, plan_labels=["w8.s2.d1", "w8.s4"], reps=2)
    out = capsys.readouterr().out
    assert [r["plan"] for r in rows[:3]] == ["w8.s2.t0.b0.d0.v1"] * 3  # the default is inserted and timed first
    wrong = [r for r in rows if r["status"] == "wrong"]
    assert {r["plan"] for r in wrong} == {"w8.s4.t0.b0.d0.v1"} and all("fwd" in r["case"] for r in wrong)
    assert "SWEEP BEST bias_gelu_fwd fp32 0.125 MiB: w8.s2.t0.b0.d1.v1" in out  # not the 0.5 ms wrong plan
    assert "SWEEP BEST bias_gelu_bwd bf16 0.0625 MiB: w8.s4.t0.b0.d0.v1" in out  # right for the backward
    assert "SWEEP WRONG w8.s4.t0.b0.d0.v1 fwd" in out
    lines = (tmp_path / "sweep.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["device"] == "fake" for line in lines)
    assert [r["status"] for r in rows[-3:]] == ["repeat"] * 3  # the default again at the end
    assert all(r["plan"] == "w8.s2.t0.b0.d0.v1" for r in rows[-3:])
    assert "(again at the end: " in out
    ok = [r for r in rows if r["status"] == "ok" and r["plan"] == "w8.s2.t0.b0.d1.v1"]
    assert all(r["vs_torch"] == pytest.approx(1 / 0.8) for r in ok)
    assert ew.TUNING == {}  # left as found


def test_spent_budget_times_only_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(ks, "SWEEP_CASES", (("residual_add fp32+fp32", "res", torch.float32, 0.125),))
    monkeypatch.setattr(ks, "CHECK_SHAPES", (((5, 101), 1),))
    monkeypatch.setattr(ew, "residual_add_forward", lambda x, y: x + y)
    monkeypatch.setattr(common, "graph_times", _fake_times)
    monkeypatch.setattr(kc, "warm_compile", lambda specs, dev, workers: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake")
    monkeypatch.setattr(ew, "_l2_bytes", lambda index: 0)
    rows = ks.run_sweep(tmp_path, torch.device("cpu"), budget_s=-1, plan_labels=["w8.s2", "w8.s2.d1"], reps=2)
    assert [r["status"] for r in rows] == ["ok", "skipped (budget)", "repeat"]


def test_sweep_plan_kinds_and_case_filter() -> None:
    assert ks.parse_sweep_plan("w16.s3.d1@fwd+bwd") == ("w16.s3.d1", frozenset({"fwd", "bwd"}))
    assert ks.parse_sweep_plan("w8.s2")[1] == frozenset(ks.KINDS)
    for bad in ("w16.s3@gelu", "w8.q2@res"):
        with pytest.raises(ValueError):
            ks.parse_sweep_plan(bad)
    cases = ks.select_cases(ks.SWEEP_CASES, ["residual_add bf16+bf16 16 MiB", "fwd/fp32"])
    assert [(c[0], c[3]) for c in cases] == [("bias_gelu_fwd fp32", 256), ("residual_add bf16+bf16", 16)]
    assert ks.select_cases(ks.SWEEP_CASES, None) == ks.SWEEP_CASES
    with pytest.raises(ValueError, match="no sweep case"):
        ks.select_cases(ks.SWEEP_CASES, ["nothing"])


def test_tuned_plans_line(tmp_path) -> None:
    """One TUNED_PLANS entry per op:dtype: the best geometric mean over that key's sizes, never a plan that was
    wrong or not timed on every size; the printed string parses as PEERLINE_KERNEL_PLANS."""
    from peerline.kernels import plan

    def row(case: str, label: str, vs: float | None) -> dict:
        base = {"case": case, "plan": label, "torch_GBps": 4000.0, "copy_GBps": 4000.0}
        if vs is None:
            return {**base, "status": "wrong", "error": "x"}
        return {**base, "status": "ok", "GBps": 4000.0 * vs, "vs_torch": vs, "vs_copy": vs}

    rows = [row("residual_add bf16+bf16 256 MiB", "w8.s2.t0.b0.d0.v1", 0.90),
            row("residual_add bf16+bf16 16 MiB", "w8.s2.t0.b0.d0.v1", 0.90),
            row("residual_add bf16+bf16 256 MiB", "w4.s4.t256.b0.d1.v1", 0.95),
            row("residual_add bf16+bf16 16 MiB", "w4.s4.t256.b0.d1.v1", 0.93),
            row("residual_add bf16+bf16 256 MiB", "w8.s3.t0.b0.d1.v1", 1.20),  # only one size timed
            row("residual_add bf16+bf16 256 MiB", "w8.s4.t0.b0.d1.v1", 1.50),  # wrong at 16 MiB
            row("residual_add bf16+bf16 16 MiB", "w8.s4.t0.b0.d1.v1", None),
            row("bias_gelu_fwd fp32 256 MiB", "w16.s3.t0.b0.d1.v1", 2.0),
            row("bias_gelu_fwd fp32 256 MiB", "w8.s2.t0.b0.d0.v1", 1.5)]
    assert ks.tuned_choice(rows)["residual_add:bf16"][0] == "w4.s4.t256.b0.d1.v1"
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = ks.summarize(path)
    (paste,) = [line for line in lines if line.startswith("SWEEP TUNED_PLANS")]
    entries = paste.split('"')[1]
    assert entries == "bias_gelu_fwd:fp32=w16.s3.d1,residual_add:bf16=w4.s4.t256.d1"
    parsed = plan.parse_op_plans(entries)
    assert parsed["residual_add:bf16"] == plan.LaunchPlan(warps=4, stages=4, tile_chunks=256, direct_store=True)
    for label in ("w8.s2.t0.b0.d0.v1.o1", "w8.s4.t0.b0.d1.v1.l1", "w4.s8.t256.b2.d0.v2.l1.o1", "w8.s2.t0.b0.d0.v1"):
        assert plan.parse_plan(ks._short(label)) == plan.parse_plan(label)
    assert ks._short("w8.s2.t0.b0.d0.v1.o1") == "w8.s2.o1"


def test_short_label_keeps_the_cache_hint() -> None:
    from peerline.bench.kernel_tools.sweep import _short

    assert _short("w4.s4.t256.b0.d1.v1.l1.h1") == "w4.s4.t256.d1.l1.h1"
    assert _short("w8.s2.t0.b0.d0.v1") == "w8.s2"


def test_tuned_plans_split_by_l2_size_class() -> None:
    """Rows whose bytes fit in their device's L2 choose an OP:DTYPE:l2 plan of their own."""
    mib = 1 << 20

    def row(mib_x: int, label: str, vs: float) -> dict:
        return {"case": f"residual_add bf16+bf16 {mib_x} MiB", "plan": label, "status": "ok", "vs_torch": vs,
                "bytes": 3 * mib_x * mib, "l2_bytes": 50 * mib}

    rows = [row(16, "w8.s2.t256.b0.d1.v1.l1.h2", 1.13), row(16, "w4.s4.t256.b0.d1.v1.l1.h1.r1", 1.00),
            row(256, "w8.s2.t256.b0.d1.v1.l1.h2", 0.97), row(256, "w4.s4.t256.b0.d1.v1.l1.h1.r1", 1.01)]
    choice = ks.tuned_choice(rows)
    assert choice["residual_add:bf16:l2"][0] == "w8.s2.t256.b0.d1.v1.l1.h2"
    assert choice["residual_add:bf16"][0] == "w4.s4.t256.b0.d1.v1.l1.h1.r1"


def test_sweep_sizes_replace_the_cases_sizes() -> None:
    kept = ks.select_cases(ks.SWEEP_CASES, ["residual_add"])
    assert {c[3] for c in kept} == {16, 256, 1024}
    resized = ks.with_sizes(kept, [8, 32])
    assert len(resized) == 4 and {c[3] for c in resized} == {8, 32}
    assert {(c[0], c[2]) for c in resized} == {(c[0], c[2]) for c in kept}
    assert ks.with_sizes(kept, None) is kept


def test_bad_sweep_mib_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--sweep", "--sweep-mib", "8,-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sweep-mib needs sizes > 0" in err[0]
