"""--shard-optimizer (ZeRO-1) on the CPU (gloo): dp=2 and pp=2 x dp=2 equal the same grid unsharded within 1e-6
per iteration (losses and every layer's parameter checksums), with about 1/dp of the optimizer state per rank.
pp=2 x dp=2 runs ZB-H1, whose gradients become final in the deferred W steps (the buckets' hooks fire there).
--precision master with bf16 compute (bf16 shards, fp32 masters and moments of each shard: ShardedMasterAdamW)
likewise, and its checkpoints resume across sharded and unsharded runs bit for bit."""

import sys

import pytest

from tests.helpers import assert_same_run, forkrun_cmd, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ARGS = ["--hidden", "16", "--layers", "4", "--seq", "4", "--micro-batch-size", "1", "--iters", "3",
        "--first-bucket-mb", "0.001", "--bucket-mb", "0.004"]  # several buckets of a small model


def _pair(tmp_path, nproc: int, args: list[str], name: str) -> tuple[dict, dict]:
    runs = {}
    for kind, extra in (("plain", []), ("sharded", ["--shard-optimizer"])):
        proc, res = run_job(forkrun_cmd(nproc), [*args, *extra], tmp_path, f"{name}-{kind}", timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[kind] = res
    return runs["sharded"], runs["plain"]


def _check_memory(sharded: dict, plain: dict, dp: int) -> None:
    """Optimizer state per rank: about 1/dp of the unsharded run's (padding and step counts aside)."""
    for mine, full in zip(sharded["optimizer_state_bytes"], plain["optimizer_state_bytes"], strict=True):
        assert 0 < mine <= full / dp * 1.25 + 4096, (sharded["optimizer_state_bytes"], plain["optimizer_state_bytes"])


def test_dp2_sharded_equals_unsharded(tmp_path):
    sharded, plain = _pair(tmp_path, 2, [*ARGS, "-m", "2", "--dp", "2", "--schedule", "1f1b"], "dp2")
    assert sharded["config"]["shard_optimizer"] is True
    assert_same_run(sharded, plain, rtol=1e-6)
    _check_memory(sharded, plain, 2)


def test_pp2_dp2_zero_bubble_sharded_equals_unsharded(tmp_path):
    sharded, plain = _pair(tmp_path, 4, [*ARGS, "-m", "3", "--pp", "2", "--dp", "2", "--schedule", "zb-h1"],
                           "pp2dp2")
    assert_same_run(sharded, plain, rtol=1e-6)
    assert {k.split("/")[0] for k in sharded["layer_checksums"]} == {"r0", "r1"}
    _check_memory(sharded, plain, 2)


def test_dp1_is_a_notice_and_no_op(tmp_path):
    args = [*ARGS, "-m", "2", "--iters", "2"]
    proc, sharded = run_job([sys.executable], [*args, "--shard-optimizer"], tmp_path, "one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--shard-optimizer: dp=1" in proc.stdout + proc.stderr
    proc, plain = run_job([sys.executable], args, tmp_path, "one-plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sharded["losses"] == plain["losses"] and sharded["layer_checksums"] == plain["layer_checksums"]
    assert sharded["optimizer_state_bytes"] == plain["optimizer_state_bytes"]


MASTER_BF16 = [*ARGS, "--dtype", "bf16", "--precision", "master"]


@pytest.mark.parametrize("recipe", ["master", "bf16"])
def test_dp2_bf16_shards_equal_unsharded(tmp_path, recipe: str):
    """bf16 shards: master's fp32 masters and moments of each shard, or bf16's own bf16 state."""
    args = [*ARGS, "--dtype", "bf16", "--precision", recipe, "-m", "2", "--dp", "2"]
    sharded, plain = _pair(tmp_path, 2, args, f"{recipe}-dp2")
    assert sharded["config"]["precision"] == recipe
    # the record's state_bytes: optimizer state per bf16 parameter byte, fp32 master + moments (12 / 2) or bf16
    # moments (4 / 2); the sharded run holds about half of it
    held = plain["state_bytes"]
    assert abs(held["optimizer_state"][0] / held["parameters"][0] - {"master": 6, "bf16": 2}[recipe]) < 0.05, held
    assert sharded["state_bytes"]["optimizer_state"][0] <= held["optimizer_state"][0] / 2 * 1.25 + 4096
    assert_same_run(sharded, plain, rtol=1e-6)
    _check_memory(sharded, plain, 2)


@pytest.mark.parametrize("first,then", [("sharded", "plain"), ("plain", "sharded")])
def test_master_bf16_checkpoint_resumes_across_sharding(tmp_path, first: str, then: str):
    """Three iterations saved one way, resumed the other for three more: the six-iteration run's losses and
    parameters (the masters travel in the checkpoint, so the resumed run steps from them)."""
    base = [*MASTER_BF16, "-m", "2", "--dp", "2"]
    flag = {"sharded": ["--shard-optimizer"], "plain": []}
    proc, full = run_job(forkrun_cmd(2), [*base, "--iters", "6"], tmp_path, "full", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ck = str(tmp_path / "ck")
    proc, _ = run_job(forkrun_cmd(2), [*base, *flag[first], "--iters", "3", "--save", ck], tmp_path, "first",
                      timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = run_job(forkrun_cmd(2), [*base, *flag[then], "--iters", "6", "--resume", ck], tmp_path,
                            "second", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["iterations"] == [4, 5, 6]
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["layer_checksums"] == full["layer_checksums"]
