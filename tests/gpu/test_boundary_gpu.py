"""Stage boundaries of several tensors on GPUs: the tuple model (tests/multiproc/models/tuple_model.py: tuples and
dicts of fp32, bf16 and int64 tensors between its layers) at pp=2 over the copy engine (one packed message per
handoff, also cut in halves by --p2p-split) and over NCCL, captured into a graph and eager, against one GPU.

Tolerances as in test_pipeline_gpu.py: fp32 runs the same kernels on the same shapes per stage, so pp=2 matches one
GPU to 1e-5 relative and the graph matches eager to 1e-6; bf16 autocast (the default) to 2e-2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import REPO, Run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

MODELS = Path(__file__).resolve().parents[1] / "multiproc" / "models"
ENV = (("PYTHONPATH", f"{MODELS}{os.pathsep}{REPO}"),)
SPLIT_ALL = (*ENV, ("PEERLINE_P2P_SPLIT_MIN", "0"))  # the tiny model's messages are split too
TINY = ("--model", "tuple_model:build", "--hidden", "256", "--seq", "64", "--micro-batch-size", "2", "--iters", "5",
        "--warmup-iters", "2", "-m", "4")
FP32 = (*TINY, "--dtype", "fp32")
REF = Run("tuple_ref", (*FP32, "--no-graph"), env=ENV)
REF_BF16 = Run("tuple_ref_bf16", (*TINY, "--no-graph"), env=ENV)

# one GPU: check -> (run, rtol) against REF
ONE_GPU = {
    "graph_vs_eager": (Run("tuple_g1", (*FP32, "--graph"), env=ENV), 1e-6),
    "stages2_graph_vs_one_stage": (Run("tuple_s2g", (*FP32, "--stages", "2", "--graph"), env=ENV), 1e-6),
}

# pp=2 (fp32) flags -> the run against REF at 1e-5
PP2 = {
    "1f1b-copy-engine-graph": ("--schedule", "1f1b", "--p2p", "copy-engine", "--graph"),
    "gpipe-copy-engine-no-graph": ("--schedule", "gpipe", "--p2p", "copy-engine", "--no-graph"),
    "1f1b-copy-engine-graph-split": ("--schedule", "1f1b", "--p2p", "copy-engine", "--graph", "--p2p-split"),
    "1f1b-nccl-graph": ("--schedule", "1f1b", "--p2p", "nccl", "--graph"),
    "gpipe-nccl-no-graph": ("--schedule", "gpipe", "--p2p", "nccl", "--no-graph"),
}


def graph_flag(args: tuple[str, ...]) -> bool | None:
    return True if "--graph" in args else False if "--no-graph" in args else None


@pytest.mark.parametrize("check", list(ONE_GPU))
def test_one_gpu(pipeline_runs, check: str) -> None:
    run, rtol = ONE_GPU[check]
    got, ref = pipeline_runs.results(run, REF)
    assert_matches(got, ref, Expect(rtol, graph=graph_flag(run.args)))


@pytest.mark.gpu2
@pytest.mark.parametrize("combo", list(PP2))
def test_pp2_structures_match_one_gpu(pipeline_runs, combo: str) -> None:
    flags = PP2[combo]
    r = Run(f"tuple_pp2_{combo}", (*FP32, "--pp", "2", *flags), nproc=2, env=SPLIT_ALL)
    got, ref = pipeline_runs.results(r, REF)
    transport = flags[flags.index("--p2p") + 1]
    assert_matches(got, ref, Expect(1e-5, world=2, graph=graph_flag(flags), transport=transport))


@pytest.mark.gpu2
def test_pp2_bf16_graph_matches_one_gpu(pipeline_runs) -> None:
    r = Run("tuple_pp2_bf16", (*TINY, "--pp", "2", "--graph"), nproc=2, env=ENV)
    got, ref = pipeline_runs.results(r, REF_BF16)
    assert_matches(got, ref, Expect(2e-2, world=2, graph=True, transport="copy-engine"))
