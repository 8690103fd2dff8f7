"""The main job with bucketed gradient sync against per-parameter all-reduce, on CPU ranks (gloo): with dp = 2
both average the same two numbers per element, so losses and weights must agree to the bit, for odd bucket
sizes (a 1 KiB first bucket, 3 KiB buckets: most layers' weights are larger and close the bucket they join)
on a pp=2 x dp=2 grid. (pp=2 x dp=1 runs the buckets without any all-reduce: test_pipeline_cpu's pp=2 checks
cover it.)"""

from __future__ import annotations

import pytest

from tests.helpers import TINY, forkrun_cmd, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ODD = ["--bucket-mb", "0.003", "--first-bucket-mb", "0.001", "-m", "3"]


def test_buckets_equal_per_parameter_sync_bitwise_pp2_dp2(tmp_path) -> None:
    pp, dp, world = "2", "2", 4
    runs = {}
    for sync in ("buckets", "per-param"):
        proc, res = run_job(forkrun_cmd(world), [*TINY, *ODD, "--pp", pp, "--dp", dp, "--grad-sync", sync],
                            tmp_path, f"{sync}-{pp}x{dp}")
        assert proc.returncode == 0 and res is not None, proc.stdout + proc.stderr[-3000:]
        runs[sync] = res
    assert runs["buckets"]["losses"] == runs["per-param"]["losses"]
    assert runs["buckets"]["layer_checksums"] == runs["per-param"]["layer_checksums"]
