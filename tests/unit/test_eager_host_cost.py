"""Eager host cost: the cheap autocast-off region the engine and the fused linear use, and the CPU smoke runs of the
benchmark suites that measure it (hostcost's engine part, eager)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from peerline.kernels import fused_linear
from tests.forkjob import BENCH
from tests.helpers import run_command


def test_autocast_off_switches_off_and_restores_reentrantly() -> None:
    off = fused_linear.autocast_off("cpu")
    assert fused_linear.autocast_off("cpu") is off  # made once
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with off:
            assert not torch.is_autocast_enabled("cpu")
            with off:
                assert not torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with off:  # outside any region: stays off, and off after
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_off_gives_what_torch_autocast_disabled_gives() -> None:
    """The same ops inside the cheap region and inside torch.autocast(enabled=False), nested in a bf16 region."""
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowp = torch.nn.functional.linear(x, w)
        with fused_linear.autocast_off("cpu"):
            mine = torch.nn.functional.linear(x, w)
        with torch.autocast("cpu", enabled=False):
            ref = torch.nn.functional.linear(x, w)
    assert lowp.dtype == torch.bfloat16 and mine.dtype == torch.float32
    assert torch.equal(mine, ref)


def test_fused_linear_backward_under_autocast_matches_disabled_backward() -> None:
    """A backward run inside an autocast region (not the engine's way) gives the gradients of one run outside."""
    torch.manual_seed(3)
    state = fused_linear.FusedLinear(16, 8).state_dict()
    x0 = torch.randn(2, 4, 16)
    grads = []
    for inside in (False, True):
        lin = fused_linear.FusedLinear(16, 8, impl="peerline")
        lin.load_state_dict(state)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
            if inside:
                y.float().square().sum().backward()
        if not inside:
            y.float().square().sum().backward()
        grads.append((x.grad, lin.weight.grad, lin.bias.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_hostcost_and_eager_suites_run_on_the_cpu(tmp_path: Path) -> None:
    """Both suites' --quick runs: the engine's per-action host times and the eager comparison, every variant."""
    env = {**os.environ, "PEERLINE_DEVICE": "cpu"}
    # the bench forked from the test fork server (tests/forkjob.py); the children it starts are real processes
    proc = run_command([sys.executable, BENCH, "hostcost", "eager", "--quick", "--out", str(tmp_path)], tmp_path,
                       env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    cases = {r["suite"]: [] for r in records}
    for r in records:
        cases[r["suite"]].append(r["case"])
    for action in ("F", "B", "iteration (host)", "engine own (host, per iteration)"):
        assert any(c.startswith(f"engine {action} (") for c in cases["hostcost"]), (action, cases["hostcost"])
    assert any("1 GPU peerline --stages 1 --no-graph --precision autocast vs plain torch" in c
               for c in cases["eager"]), cases["eager"]
    single = next(r for r in records if r["suite"] == "eager" and "1 GPU" in r["case"])
    assert single["extra"]["recipe"] == "autocast"
    assert single["extra"]["peerline_losses"] == single["extra"]["plain_losses"]  # same model, data, fp32 on the CPU
