"""The kernels benchmark suites run on the CPU in quick mode (a smoke test: torch against torch)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from peerline.bench.benchkit import BenchContext
from peerline.bench.suites import batch_streams, kernels

pytestmark = pytest.mark.timeout(120)


def test_kernels_suite_quick_on_cpu(tmp_path) -> None:
    ctx = BenchContext(out_dir=tmp_path, device=torch.device("cpu"), quick=True)
    kernels.run(argparse.Namespace(), ctx)
    batch_streams.run(argparse.Namespace(), ctx)  # needs CUDA: records nothing on the CPU
    cases = {r.case for r in ctx.records}
    assert any(c.startswith("bias_gelu_fwd bf16") for c in cases)
    assert any(c.startswith("bias_gelu_bwd fp32") for c in cases)
    assert any(c.startswith("residual_add fp32+bf16") for c in cases)
    assert all(r.peerline > 0 and r.anchor > 0 for r in ctx.records)
    jpath, _ = ctx.write("kernels")
    rows = [json.loads(line) for line in jpath.read_text().splitlines()]
    assert len(rows) == len(ctx.records) and rows[0]["suite"] == "kernels"


def _rec(case: str, mib: float, peerline: float, anchor: float, anchor_name: str):
    from peerline.bench.benchkit import Record

    return Record("kernels", case, "GB/s", peerline, anchor, anchor_name, sizes={"x_MiB": mib})


def test_goal_lines_judge_the_default_kernel_at_the_goal_sizes() -> None:
    recs = [_rec("bias_gelu_fwd bf16 256 MiB", 256, 3300, 1000, "torch F.gelu(x + b)"),  # 3.3x: met
            _rec("bias_gelu_fwd bf16 256 MiB", 256, 3300, 4100, "d2d copy of the same bytes"),  # 0.80: missed
            _rec("bias_gelu_fwd bf16 16 MiB", 16, 100, 1000, "torch F.gelu(x + b)"),  # only the >= 16 MiB goal
            _rec("bias_gelu_bwd bf16 16 MiB", 16, 990, 1000, "torch gelu_backward + bias sum"),  # 0.99: missed
            _rec("bias_gelu_fwd bf16 256 MiB: 8 compute warps, 1 + erff", 256, 1, 1000, "default: ...")]
    lines = kernels.goal_lines(recs)
    assert lines == ["GOAL MET bias_gelu_fwd bf16 256 MiB: 3.30x torch F.gelu(x + b) (>= 3)",
                     "GOAL MISSED bias_gelu_fwd bf16 256 MiB: 0.80x d2d copy of the same bytes (>= 0.9)",
                     "GOAL MET bias_gelu_fwd bf16 256 MiB: 3.30x torch F.gelu(x + b) (>= 1)",
                     "GOAL MISSED bias_gelu_fwd bf16 16 MiB: 0.10x torch F.gelu(x + b) (>= 1)",
                     "GOAL MISSED bias_gelu_bwd bf16 16 MiB: 0.99x torch gelu_backward + bias sum (>= 1)"], lines


def test_time_interleaved_times_each_fn_on_cpu() -> None:
    """One Timing per fn, each over its own reps (the CPU path; the rotation itself is CUDA-event timing)."""
    import time

    from peerline.bench.benchkit import time_interleaved

    calls = {"fast": 0, "slow": 0}

    def fast() -> None:
        calls["fast"] += 1

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.002)

    t_fast, t_slow = time_interleaved([fast, slow], warmup=1, reps=5, device=torch.device("cpu"))
    assert calls == {"fast": 6, "slow": 6} and t_fast.reps == t_slow.reps == 5
    assert t_slow.median_ms > 1.5 and t_fast.median_ms < t_slow.median_ms
