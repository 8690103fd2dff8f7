"""The 4- and 8-rank grids of issue 11 on the CPU (gloo), against the single-process reference.

Machines with 4 and 8 GPUs are not lent yet; these runs check the same code paths (mesh layout, dp groups per
stage, pipelines of 4 and 8 stages, 1F1B) on the CPU, the ranks forked as torchrun would start them
(tests/forkjob.py). Each grid with M microbatches per replica equals one process with M x dp microbatches (fp32, 1e-5
relative).
"""

import sys

import pytest

from tests.helpers import assert_same_run, cpu_env, forkrun_cmd, run_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

GRID_ARGS = ["--hidden", "16", "--layers", "8", "--seq", "4", "--micro-batch-size", "1", "--iters", "2",
             "--schedule", "1f1b"]


@pytest.mark.parametrize("nproc,pp,dp,m", [(4, 2, 2, 2), (4, 4, 1, 4), (8, 8, 1, 8), (8, 4, 2, 4), (8, 2, 4, 2)])
def test_grid_equals_single_process(tmp_path, nproc, pp, dp, m):
    proc, ref = run_job([sys.executable], [*GRID_ARGS, "-m", str(m * dp)], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    proc, res = run_job(forkrun_cmd(nproc), [*GRID_ARGS, "-m", str(m), "--pp", str(pp), "--dp", str(dp),
                                               "--graph"], tmp_path, f"grid{pp}x{dp}", timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["world_size"] == nproc
    assert_same_run(res, ref)
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {f"r{r}" for r in range(dp)}


@pytest.mark.parametrize("nproc,pp,dp,m,memory", [(4, 2, 2, 3, "fast"), (4, 4, 1, 5, "fast"), (4, 4, 1, 5, "1f1b")])
def test_zero_bubble_grid_equals_single_process(tmp_path, nproc, pp, dp, m, memory):
    """ZB-H1 (B and W split, W deferred, the all-reduce after the last W) with M not a multiple of pp; and its
    order within 1F1B's memory (--zb-memory 1f1b)."""
    args = [a if a != "1f1b" else "zb-h1" for a in GRID_ARGS] + ["--zb-memory", memory]
    proc, ref = run_job([sys.executable], [*args, "-m", str(m * dp)], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    proc, res = run_job(forkrun_cmd(nproc), [*args, "-m", str(m), "--pp", str(pp), "--dp", str(dp)], tmp_path,
                        f"zb{pp}x{dp}", timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(res, ref)
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {f"r{r}" for r in range(dp)}


@pytest.mark.parametrize("schedule,nproc,pp,dp,m,v", [("interleaved", 2, 2, 1, 4, 2), ("zbv", 4, 2, 2, 3, 2),
                                                      ("zbv", 4, 4, 1, 5, 2), ("interleaved", 4, 4, 1, 4, 2),
                                                      ("zb-interleaved", 2, 2, 1, 5, 4),
                                                      ("zb-interleaved", 4, 2, 2, 3, 2),
                                                      ("zb-interleaved", 4, 4, 1, 5, 2)])
def test_placed_schedules_equal_single_process(tmp_path, schedule, nproc, pp, dp, m, v):
    """Several stages per rank (interleaved and zb-interleaved: rank r holds r, r+pp, ..., the wrap-around edge
    last -> first rank; zbv: r and 2pp-1-r, the first rank feeding and scoring) against one process running the
    same layers."""
    args = [a if a != "1f1b" else schedule for a in GRID_ARGS]
    proc, ref = run_job([sys.executable], [*GRID_ARGS, "-m", str(m * dp)], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    proc, res = run_job(forkrun_cmd(nproc), [*args, "-m", str(m), "--pp", str(pp), "--dp", str(dp), "--stages",
                                               str(v)], tmp_path, f"{schedule}{pp}x{dp}", timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(res, ref)
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {f"r{r}" for r in range(dp)}


def test_interleaved_m_not_a_multiple_of_pp_is_one_error_line(tmp_path):
    args = [a if a != "1f1b" else "interleaved" for a in GRID_ARGS]
    proc, _ = run_job(forkrun_cmd(2), [*args, "-m", "3", "--pp", "2", "--stages", "2"], tmp_path, "bad")
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("peerline: error:")]
    assert len(lines) == 1 and "M=3 is not a multiple of pp=2" in lines[0], proc.stderr[-2000:]


def test_a_hung_rank_under_zbv_is_named_by_microbatch_and_stages(tmp_path):
    """ZBV routes messages over other channels and ids than their kind and microbatch: the watchdog's line on rank
    0 still names microbatches of this run and edges between adjacent stages, one of them its own (0 or 3), and
    each rank with both of its stages."""
    import re

    from tests.helpers import cpu_env

    args = [a if a != "1f1b" else "zbv" for a in GRID_ARGS]
    proc, _ = run_job(forkrun_cmd(2), [*args, "-m", "4", "--pp", "2", "--stages", "2", "--iters", "4",
                                       "--timeout-s", "4"], tmp_path, "hang", timeout=120,
                      env=cpu_env(PEERLINE_FAULT="hang:rank=1:iter=2"))
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("peerline: error: rank 0 ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("peerline: error: rank 0 (stages 0, 3) ") and "rank 1 (stages 1, 2)" in lines[0]
    waits = re.findall(r"(act|grad) mb (\d+) (?:from|to) rank 1 \(edge stage (\d)->(\d)\)", lines[0])
    assert waits, lines[0]
    for _kind, mb, a, b in waits:
        assert int(mb) < 4 and abs(int(a) - int(b)) == 1 and {int(a), int(b)} & {0, 3}, lines[0]


@pytest.mark.parametrize("schedule,m,v,order", [("zbv", 8, 2, "searched"), ("zb-interleaved", 5, 4, "searched"),
                                                 ("zbv", 5, 2, "list")])
def test_other_zero_bubble_orders_equal_single_process(tmp_path, schedule, m, v, order):
    """--zb-order searched (pipeline/order_search.py: the rank orders moved for B longer than W) and list (list
    scheduling in unit time; zbv's default, the paper's order, runs in the grids above) at pp=2, with graphs,
    against one process running the same layers."""
    args = [a if a != "1f1b" else schedule for a in GRID_ARGS]
    proc, ref = run_job([sys.executable], [*GRID_ARGS, "-m", str(m)], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    proc, res = run_job(forkrun_cmd(2), [*args, "-m", str(m), "--pp", "2", "--stages", str(v), "--graph",
                                         "--zb-order", order], tmp_path, f"{schedule}-{order}", timeout=500,
                        env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(res, ref)
