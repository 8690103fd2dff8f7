"""Faults named right and out of memory as one line, on GPUs: a killed and a hung rank at pp=2 x dp=2 (4 GPUs, NCCL
all-reduce and copy-engine handoffs) named by every survivor; a run too large for its GPUs (2 GPUs) ends with one
line per failing rank naming the rank, the allocation, every rank's peak memory and the flags that help."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.jobs import fault_env
from tests.multiproc.failures_util import STARTUP_S, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]

MODEL = ["--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "-m", "4", "--kernels", "torch"]
DEADLINE = 10




@pytest.mark.gpu4
@pytest.mark.parametrize("fault", ["kill:rank=1:iter=6", "hang:rank=1:iter=6"])
def test_pp2_dp2_names_the_rank_that_stopped(tmp_path: Path, fault: str):
    """Rank 1 stops after the graph is captured (iteration 6 > 3 warm-up iterations): rank 0 waits for its
    gradient, rank 3 for its all-reduce, rank 2 for rank 3; every survivor's line names rank 1."""
    ranks = spawn(4, [*MODEL, "--dp", "2", "--iters", "10", "--timeout-s", str(DEADLINE)], tmp_path,
                  fault_env(fault), limit_s=STARTUP_S + DEADLINE + 90)
    for i in (0, 2, 3):
        r = ranks[i]
        assert r.rc != 0 and len(r.errors()) == 1, (i, r.err)
        assert "; rank 1 (stage 1) " in r.errors()[0], (i, r.err)
        assert "Traceback" not in r.err, (i, r.err)
    assert ranks[1].rc == (9 if fault.startswith("kill") else 3), ranks[1].err


@pytest.mark.gpu2
def test_out_of_memory_is_one_line_with_peaks_and_remedies(tmp_path: Path):
    """GPipe keeps every microbatch's activations: 8 microbatches x 4 layers x about 9.7 GB (input, fc1 and GELU
    outputs of 8 x 8192 x 4096, fp32) per stage cannot fit 80 or 140 GiB; the start-up probe (no gradients, one
    microbatch) does. hidden 4096 keeps the weights small, so building the model on the CPU stays quick."""
    args = ["--hidden", "4096", "--layers", "8", "--seq", "8192", "--micro-batch-size", "8", "-m", "8",
            "--schedule", "gpipe", "--dtype", "fp32", "--kernels", "torch", "--no-graph", "--iters", "2",
            "--timeout-s", "60"]
    ranks = spawn(2, args, tmp_path, fault_env(), limit_s=STARTUP_S + 200)
    lines = [line for r in ranks for line in r.errors()]
    assert all(r.rc != 0 for r in ranks), [r.err[-2000:] for r in ranks]
    oom = [line for line in lines if "ran out of GPU memory" in line]
    assert oom, lines
    for line in oom:
        assert "during iteration 1" in line and "tried to allocate" in line, line
        assert "peak memory by rank: 0: " in line and "1: " in line, line
        assert "--micro-batch-size 4 (now 8)" in line and "--recompute full" in line, line
        assert "--schedule 1f1b" in line, line
    assert not any("Traceback" in r.err for r in ranks), [r.err[-2000:] for r in ranks]
