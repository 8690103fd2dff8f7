"""The pipeline benchmark suite's output on GPUs, checked, not timed: every (configuration, variant) has a record
with a finite ratio, and each configuration has a Chrome trace of one eager iteration whose spans are consistent
with the pipeline's dependencies. pp=2 on two GPUs; pp=2 x dp=2 and pp=4 on four. Short settings: the figures come
from tools/gpu_checks.sh's BENCH runs, not from here."""

from __future__ import annotations

import pytest

from tests.gpu.compare import bench_problems, read_records, timeline_problems
from tests.gpu.jobs import REPO, gpu_env, launcher, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]

CONFIGS = ["compute", "launch"]
SHORT = ["--pipeline-iters", "3", "--reps", "3", "--warmup", "1"]


def check_suite(out, name: str, nproc: int, dp: int, variants: list[str]) -> None:
    res = out / name
    cmd = [*launcher(nproc), str(REPO / "launch" / "bench.py"), "pipeline", "--pipeline-configs", ",".join(CONFIGS),
           "--schedules", "1f1b", "--variants", "torch,eager,graph", "--pipeline-timeline", "--dp", str(dp), *SHORT,
           "--out", str(res)]
    rc, tail = run(cmd, out / f"{name}.log", 240, gpu_env())
    assert rc == 0, outcome(f"pipeline suite {name}", rc, tail, 240)
    problems = bench_problems(read_records(res / "results.jsonl"), CONFIGS, variants)
    problems += timeline_problems(res, len(CONFIGS))
    assert not problems, problems


@pytest.mark.gpu2
def test_pipeline_suite_pp2(gpu_out) -> None:
    check_suite(gpu_out, "bench_pp2", 2, 1, ["eager"])


@pytest.mark.gpu4
@pytest.mark.parametrize("grid,dp", [("pp2dp2", 2), ("pp4", 1)])
def test_pipeline_suite_grids(gpu_out, grid: str, dp: int) -> None:
    check_suite(gpu_out, f"bench_{grid}", 4, dp, ["eager", "graph"])


