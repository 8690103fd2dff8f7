"""--shard-optimizer on GPUs (NCCL reduce-scatter / all-gather, CUDA graphs): each sharded run equals the same grid
unsharded within 1e-6 per iteration (losses and every layer's parameters; fp32, and bf16 autocast, whose GEMMs are
the same in both), the iteration is captured (graph=True in the record), every replica stays in step, and the
optimizer state per rank is about half. Two GPUs: pp=1 x dp=2 with graphs and eager; four: pp=2 x dp=2 with the
copy engine, 1F1B and ZB-H1 (the buckets fill in the deferred W steps), graphs on, and pp=1 x dp=4 (a quarter of the
state per rank) with graphs. With --overlap-param-gather (the all-gathers at the next iteration's start, the forward
waiting per bucket, inside the captured graph) the same dp=2 and pp=2 x dp=2 runs equal their unsharded ones alike."""

from __future__ import annotations

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TINY = ("--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "2", "--iters", "6",
        "--warmup-iters", "2", "--bucket-mb", "0.5", "--first-bucket-mb", "0.25")  # several buckets


OVERLAP = ("--shard-optimizer", "--overlap-param-gather")
#: fp32 weights (under bf16 autocast with --dtype bf16), the recipe these cases were first measured with
AUTOCAST = ("--precision", "autocast")


def _pair(pipeline_runs, name: str, args: tuple[str, ...], nproc: int, sharded: tuple[str, ...] = ("--shard-optimizer",)
          ) -> tuple[dict, dict]:
    """The sharded run (`sharded`: its flags) and the unsharded one (run once per session, shared by name)."""
    kind = "overlap" if "--overlap-param-gather" in sharded else "sharded"
    return pipeline_runs.results(Run(f"{name}_{kind}", (*args, *sharded), nproc=nproc),
                                 Run(f"{name}_plain", args, nproc=nproc))


def _state_halved(sharded: dict, plain: dict, dp: int = 2) -> None:
    for mine, full in zip(sharded["optimizer_state_bytes"], plain["optimizer_state_bytes"], strict=True):
        assert 0 < mine <= (1.1 / dp) * full, (sharded["optimizer_state_bytes"], plain["optimizer_state_bytes"])


@pytest.mark.gpu2
@pytest.mark.parametrize("dtype,graph,recipe", [("fp32", "--graph", "autocast"), ("fp32", "--no-graph", "autocast"),
                                                ("bf16", "--graph", "autocast"), ("bf16", "--graph", "master")])
def test_dp2_sharded_equals_unsharded(pipeline_runs, dtype: str, graph: str, recipe: str) -> None:
    """master with bf16: bf16 shards, ShardedMasterAdamW's fp32 masters and moments of each shard."""
    args = (*TINY, "--dp", "2", "-m", "4", "--dtype", dtype, "--precision", recipe, graph)
    sharded, plain = _pair(pipeline_runs, f"shard_dp2_{dtype}_{recipe}{graph.replace('-', '_')}", args, 2)
    assert_matches(sharded, plain, Expect(1e-6, world=2, dp=2, graph=graph == "--graph"))
    _state_halved(sharded, plain)


@pytest.mark.gpu4
@pytest.mark.parametrize("flags", [("--shard-optimizer",), OVERLAP], ids=["sharded", "overlapped-gather"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_dp2_sharded_equals_unsharded(pipeline_runs, schedule: str, flags: tuple[str, ...]) -> None:
    """--shard-optimizer, and with --overlap-param-gather, at pp=2 x dp=2 over the copy engine."""
    args = (*TINY, "--pp", "2", "--dp", "2", "-m", "4", "--dtype", "fp32", "--schedule", schedule,
            "--p2p", "copy-engine", "--graph")
    sharded, plain = _pair(pipeline_runs, f"shard_pp2dp2_{schedule.replace('-', '_')}", args, 4, flags)
    assert_matches(sharded, plain, Expect(1e-6, world=4, dp=2, graph=True, transport="copy-engine"))
    _state_halved(sharded, plain)


@pytest.mark.gpu4
def test_dp4_sharded_equals_unsharded(pipeline_runs) -> None:
    args = (*TINY, "--dp", "4", "-m", "2", "--dtype", "fp32", "--graph")
    sharded, plain = _pair(pipeline_runs, "shard_dp4", args, 4)
    assert_matches(sharded, plain, Expect(1e-6, world=4, dp=4, graph=True))
    _state_halved(sharded, plain, dp=4)


@pytest.mark.gpu2
@pytest.mark.parametrize("dtype,graph", [("fp32", "--graph"), ("fp32", "--no-graph"), ("bf16", "--graph")])
def test_dp2_overlapped_gather_equals_unsharded(pipeline_runs, dtype: str, graph: str) -> None:
    args = (*TINY, "--dp", "2", "-m", "4", "--dtype", dtype, *AUTOCAST, graph)
    overlapped, plain = _pair(pipeline_runs, f"shard_dp2_{dtype}{graph.replace('-', '_')}", args, 2, OVERLAP)
    assert overlapped["config"]["overlap_param_gather"] is True
    assert_matches(overlapped, plain, Expect(1e-6, world=2, dp=2, graph=graph == "--graph"))
    _state_halved(overlapped, plain)
