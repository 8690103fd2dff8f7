"""The 4- and 8-rank grids of issue 11 on the CPU (gloo), against the single-process reference.

Machines with 4 and 8 GPUs are not lent yet; these runs check the same code paths (mesh layout, dp groups per
stage, pipelines of 4 and 8 stages, 1F1B) with torchrun on the CPU. Each grid with M microbatches per replica
equals one process with M x dp microbatches (fp32, 1e-5 relative).
"""

import sys

import pytest

from tests.helpers import assert_same_run, run_job, torchrun_cmd

pytestmark = pytest.mark.timeout(600)

GRID_ARGS = ["--hidden", "16", "--layers", "8", "--seq", "4", "--micro-batch-size", "1", "--iters", "2",
             "--schedule", "1f1b"]


@pytest.mark.parametrize("nproc,pp,dp,m", [(4, 2, 2, 2), (4, 4, 1, 4), (8, 8, 1, 8), (8, 4, 2, 4), (8, 2, 4, 2)])
def test_grid_equals_single_process(tmp_path, nproc, pp, dp, m):
    proc, ref = run_job([sys.executable], [*GRID_ARGS, "-m", str(m * dp)], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    proc, res = run_job(torchrun_cmd(nproc), [*GRID_ARGS, "-m", str(m), "--pp", str(pp), "--dp", str(dp),
                                               "--graph"], tmp_path, f"grid{pp}x{dp}", timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["world_size"] == nproc
    assert_same_run(res, ref)
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {f"r{r}" for r in range(dp)}
