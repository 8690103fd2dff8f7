"""GradBuckets on two GPUs with NCCL (dp = 2): runs tests/gpu/buckets_gpu_worker.py under torchrun.
Skipped without two CUDA devices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2, pytest.mark.timeout(400)]

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_buckets_nccl_dp2() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "buckets_gpu_worker.py")]
    try:
        proc = subprocess.run(cmd, cwd=HERE.parents[1], capture_output=True, text=True, timeout=360)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"GPU bucket check hung for {exc.timeout} s:\n{exc.stdout}\n{exc.stderr}")
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not fails, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
