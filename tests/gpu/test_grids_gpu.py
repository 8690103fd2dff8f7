"""The pp=2 x dp=2 and pp=4 grids on four GPUs (1F1B, copy-engine P2P), fp32, graph on and off, against one GPU
with the same model and seed and dp x the microbatches (1e-5 relative, as the two-GPU pipeline tests), and the
README's default command on four ranks (pp=4) against one GPU (bf16, 2e-2). Each run must also show the world size,
every replica's layers, the graph state asked for and the copy-engine transport."""

from __future__ import annotations

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run

pytestmark = [pytest.mark.gpu, pytest.mark.gpu4, pytest.mark.timeout(600)]

TINY8 = ("--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "2", "--iters", "5",
         "--warmup-iters", "2", "--schedule", "1f1b", "--dtype", "fp32")
REF8 = Run("grid_ref8", (*TINY8, "--no-graph", "-m", "8"))  # both grids run 8 microbatches per iteration in all
REF8_GRAPH = Run("grid_ref8_graph", (*TINY8, "--graph", "-m", "8"))
DEFAULT1 = Run("default1", ("--iters", "6"))

# grid -> (flags, dp); pp=2 x dp=2 runs M=4 per replica, pp=4 runs M=8
GRIDS = {"pp2dp2": (("--pp", "2", "--dp", "2", "-m", "4"), 2), "pp4": (("--pp", "4", "-m", "8"), 1)}


def test_reference_graph_equals_eager(pipeline_runs) -> None:
    """The references' own consistency: if this fails, the grid graph runs' failures are not the grid's."""
    got, ref = pipeline_runs.results(REF8_GRAPH, REF8)
    assert_matches(got, ref, Expect(1e-6, graph=True))


@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_grid_matches_one_gpu(pipeline_runs, grid: str, graph: str) -> None:
    flags, dp = GRIDS[grid]
    r = Run(f"{grid}{graph.replace('--', '_').replace('-', '_')}", (*TINY8, *flags, "--p2p", "copy-engine", graph),
            nproc=4)
    got, ref = pipeline_runs.results(r, REF8)
    assert_matches(got, ref, Expect(1e-5, world=4, dp=dp, graph=graph == "--graph", transport="copy-engine"))


def test_readme_default_on_four_gpus(pipeline_runs) -> None:
    got, ref = pipeline_runs.results(Run("default4", ("--iters", "6"), nproc=4), DEFAULT1)
    assert_matches(got, ref, Expect(2e-2, world=4, graph=True, transport="copy-engine"))
