"""The kernels benchmark suites run on the CPU in quick mode (a smoke test: torch against torch)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from peerline.launch.benchkit import BenchContext
from peerline.launch.suites import batch_streams, kernels

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
