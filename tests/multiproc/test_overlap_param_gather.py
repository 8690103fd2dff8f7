"""--overlap-param-gather on the CPU (gloo): the sharded step's all-gathers run at the next iteration's start and the
forward waits per bucket (grad_sync/param_gather.py). dp=2 and pp=2 x dp=2 runs equal the same runs without it bit
for bit (losses and every layer's parameter checksums: the all-gather only copies), a checkpoint saved mid-run with
it resumes to the same losses and parameters, and the flag without --shard-optimizer is one error line, exit 2."""

import sys

import pytest

from tests.helpers import PIPELINE, forkrun_cmd, run_command, run_job

pytestmark = pytest.mark.timeout(300)

ARGS = ["--hidden", "16", "--layers", "4", "--seq", "4", "--micro-batch-size", "1", "--iters", "3",
        "--first-bucket-mb", "0.001", "--bucket-mb", "0.004", "--shard-optimizer"]  # several buckets per stage
FLAG = "--overlap-param-gather"


def _job(tmp_path, nproc: int, args: list[str], name: str) -> dict:
    proc, res = run_job(forkrun_cmd(nproc), args, tmp_path, name, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return res


def _same_bitwise(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"], (got["losses"], want["losses"])
    assert got["layer_checksums"] == want["layer_checksums"]


@pytest.mark.parametrize("nproc,grid", [(2, ["--dp", "2", "-m", "2", "--schedule", "1f1b"]),
                                        (4, ["--pp", "2", "--dp", "2", "-m", "3", "--schedule", "zb-h1"])],
                         ids=["dp2", "pp2dp2"])
def test_overlapped_gather_equals_gather_after_step(tmp_path, nproc, grid):
    overlapped = _job(tmp_path, nproc, [*ARGS, *grid, FLAG], "overlap")
    plain = _job(tmp_path, nproc, [*ARGS, *grid], "plain")
    assert overlapped["config"]["overlap_param_gather"] is True
    _same_bitwise(overlapped, plain)
    assert {k.split("/")[0] for k in overlapped["layer_checksums"]} == {"r0", "r1"}
    assert overlapped["optimizer_state_bytes"] == plain["optimizer_state_bytes"]


def test_checkpoint_saved_mid_run_resumes_equal(tmp_path):
    grid = [*ARGS, "--dp", "2", "-m", "2", "--iters", "4", FLAG]
    whole = _job(tmp_path, 2, [*grid, "--save", "ck", "--save-every", "2"], "whole")
    assert whole["losses"] == _job(tmp_path, 2, [*ARGS, "--dp", "2", "-m", "2", "--iters", "4"], "unsaved")["losses"]
    resumed = _job(tmp_path, 2, [*grid, "--resume", "ck/iter_000002"], "resumed")
    assert resumed["iterations"] == [3, 4]
    _same_bitwise(resumed, {"losses": whole["losses"][2:], "layer_checksums": whole["layer_checksums"]})


def test_without_shard_optimizer_is_one_error_line(tmp_path):
    p = run_command([sys.executable, PIPELINE, "--iters", "1", FLAG], tmp_path, timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("peerline: error:")]
    assert p.returncode == 2 and errors == [
        "peerline: error: --overlap-param-gather needs --shard-optimizer (it overlaps the sharded step's parameter "
        "all-gather with the next forward; unsharded runs have no such all-gather)"], p.stderr
