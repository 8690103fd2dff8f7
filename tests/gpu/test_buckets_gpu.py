"""GradBuckets on two GPUs with NCCL (dp = 2): tests/gpu/workers/buckets_gpu_worker.py under torchrun. Bucketed
gradients equal a per-parameter all-reduce bitwise and a single-process reference within 1e-5, also on a dp group
with NCCL's CTAs capped, with the all-reduce stream at the highest priority, and through a CUDA-graph capture and
replay (the worker's docstring lists the checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.jobs import WORKERS, gpu_env, launcher, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2, pytest.mark.timeout(400)]


def test_buckets_nccl_dp2(gpu_out: Path) -> None:
    out = gpu_out / "buckets_dp2.json"
    out.unlink(missing_ok=True)
    cmd = [*launcher(2), str(WORKERS / "buckets_gpu_worker.py"), "--json", str(out)]
    rc, tail = run(cmd, gpu_out / "buckets_dp2.log", 360, gpu_env())
    assert out.exists(), outcome("buckets_gpu_worker", rc, tail, 360)
    verdicts = json.loads(out.read_text())
    assert {"priority", "graph", "graph-timing"} <= set(verdicts), verdicts
    failed = {name: v["detail"] for name, v in verdicts.items() if not v["ok"]}
    assert not failed, failed
    assert rc == 0, outcome("buckets_gpu_worker", rc, tail, 360)
