"""The zero-bubble schedules (backward split into B and W, W deferred) on GPUs against one GPU, fp32.

Reference: one GPU running the same stages as streams (`--stages N`, eager) with the same schedule: per stage the
same kernels on the same shapes and the weight gradients accumulated in the same order, so pp=N over the copy
engine or NCCL, graph or eager, must match it bitwise. A second check against the plain 1F1B run on one GPU
(1e-5, the pipeline tests' bound) shows the split itself changes nothing but rounding order. A captured run is
held to 1e-6 rather than bitwise: under stream capture cuBLAS may pick other GEMM kernels (no workspace of its
own), which sum in another order (docs/benchmarks/h200-x4 records the difference measured).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import REPO, Run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TINY = ("--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "2", "--iters", "5",
        "--warmup-iters", "2", "--dtype", "fp32")
M = {2: "4", 4: "5"}  # pp=4 with M=5: not a multiple of pp
SCHEDULES = ["zb-h1"]
GRAPH_TOL = 1e-6


def _ref(schedule: str, pp: int) -> Run:
    return Run(f"sched_ref_{schedule}_s{pp}", (*TINY, "--schedule", schedule, "--stages", str(pp), "-m", M[pp],
                                               "--no-graph"))


def _one_f_one_b(pp: int) -> Run:
    return Run(f"sched_ref_1f1b_m{M[pp]}", (*TINY, "--schedule", "1f1b", "-m", M[pp], "--no-graph"))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_one_gpu_stages_match_1f1b(pipeline_runs, schedule: str, pp: int) -> None:
    got, ref = pipeline_runs.results(_ref(schedule, pp), _one_f_one_b(pp))
    assert_matches(got, ref, Expect(1e-5, graph=False))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_one_gpu_graph_matches_eager(pipeline_runs, schedule: str, pp: int) -> None:
    r = Run(f"sched_{schedule}_s{pp}_graph", (*TINY, "--schedule", schedule, "--stages", str(pp), "-m", M[pp],
                                              "--graph"))
    got, ref = pipeline_runs.results(r, _ref(schedule, pp))
    assert_matches(got, ref, Expect(GRAPH_TOL, graph=True))


def _multi(schedule: str, pp: int, p2p: str, graph: str) -> tuple[Run, Expect]:
    flag = graph.replace("--", "_").replace("-", "_")
    r = Run(f"sched_{schedule}_pp{pp}_{p2p}{flag}", (*TINY, "--schedule", schedule, "--pp", str(pp), "-m", M[pp],
                                                     "--p2p", p2p, graph), nproc=pp)
    return r, Expect(GRAPH_TOL if graph == "--graph" else 0.0, world=pp, graph=graph == "--graph", transport=p2p)


@pytest.mark.gpu2
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("p2p", ["copy-engine", "nccl"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_matches_one_gpu_bitwise(pipeline_runs, schedule: str, p2p: str, graph: str) -> None:
    r, want = _multi(schedule, 2, p2p, graph)
    got, ref = pipeline_runs.results(r, _ref(schedule, 2))
    assert_matches(got, ref, want)


@pytest.mark.parametrize("order", ["searched", "paper"])
def test_one_gpu_zbv_orders_match_zb_h1(pipeline_runs, order: str) -> None:
    """--zb-order searched and paper on one GPU (zbv's two stages as streams of the device, captured) against the
    same two stages under zb-h1: each stage's W still runs in microbatch order, so only the order of the ranks'
    computes changes (1e-6, captured)."""
    args = (*TINY, "--stages", "2", "-m", "3")
    r = Run(f"sched_zbv_s2_{order}_graph", (*args, "--schedule", "zbv", "--zb-order", order, "--graph"))
    ref = Run("sched_ref_zb-h1_s2_m3", (*args, "--schedule", "zb-h1", "--no-graph"))
    got, want = pipeline_runs.results(r, ref)
    assert_matches(got, want, Expect(GRAPH_TOL, graph=True))


@pytest.mark.gpu2
@pytest.mark.parametrize("order", ["searched", "list"])
def test_zbv_orders_pp2_match_one_gpu(pipeline_runs, order: str) -> None:
    """--zb-order searched and list (the default, paper, runs in test_placed_pp2_matches_one_gpu_bitwise) at pp=2
    over the copy engine with graphs, against the one-GPU reference (1e-6, captured)."""
    r, want = _placed("zbv", 2, "copy-engine", "--graph")
    r = Run(f"{r.name}_zb_order_{order}", (*r.args, "--zb-order", order), nproc=2)
    got, ref = pipeline_runs.results(r, _placed_ref("zbv", 2))
    assert_matches(got, ref, want)


@pytest.mark.gpu4
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("p2p", ["copy-engine", "nccl"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4_matches_one_gpu_bitwise(pipeline_runs, schedule: str, p2p: str, graph: str) -> None:
    r, want = _multi(schedule, 4, p2p, graph)
    got, ref = pipeline_runs.results(r, _ref(schedule, 4))
    assert_matches(got, ref, want)


# Several stages per rank: interleaved and zb-interleaved (rank r holds r, r+pp, ..., the wrap-around edge) and zbv
# (r and 2pp-1-r), against one GPU running the same stages as streams with the schedule of the same per-stage work:
# 1f1b for interleaved (one whole backward per microbatch, in microbatch order), zb-h1 for zbv and zb-interleaved
# (B and W split, each stage's W in microbatch order). Same kernels, shapes and accumulation order per stage:
# bitwise in fp32.
PLACED_REF = {"interleaved": "1f1b", "zbv": "zb-h1", "zb-interleaved": "zb-h1"}
PLACED_M = {("interleaved", 2): "4", ("zbv", 2): "3", ("zbv", 4): "5", ("zb-interleaved", 2): "5",
            ("zb-interleaved", 4): "5"}  # zbv, zb-interleaved: M not a multiple of pp


def _placed_layers(pp: int, v: int) -> tuple[str, ...]:
    """TINY, with a layer per stage where pp x v stages outnumber its 8 layers."""
    return (*TINY, "--layers", str(max(8, pp * v)))


def _placed_ref(schedule: str, pp: int, v: int = 2) -> Run:
    m = PLACED_M[(schedule, pp)]
    return Run(f"sched_ref_{PLACED_REF[schedule]}_s{v * pp}_m{m}_l{max(8, pp * v)}",
               (*_placed_layers(pp, v), "--schedule", PLACED_REF[schedule], "--stages", str(v * pp), "-m", m,
                "--no-graph"))


def _placed(schedule: str, pp: int, p2p: str, graph: str, v: int = 2) -> tuple[Run, Expect]:
    flag = graph.replace("--", "_").replace("-", "_")
    r = Run(f"sched_{schedule}_v{v}_pp{pp}_{p2p}{flag}",
            (*_placed_layers(pp, v), "--schedule", schedule, "--pp", str(pp), "--stages", str(v), "-m",
             PLACED_M[(schedule, pp)], "--p2p", p2p, graph), nproc=pp)
    return r, Expect(GRAPH_TOL if graph == "--graph" else 0.0, world=pp, graph=graph == "--graph", transport=p2p)


@pytest.mark.gpu2
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("p2p", ["copy-engine", "nccl"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_placed_pp2_matches_one_gpu_bitwise(pipeline_runs, schedule: str, p2p: str, graph: str) -> None:
    r, want = _placed(schedule, 2, p2p, graph)
    got, ref = pipeline_runs.results(r, _placed_ref(schedule, 2))
    assert_matches(got, ref, want)


@pytest.mark.gpu2
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
def test_interleaved_three_stages_per_rank_pp2(pipeline_runs, graph: str) -> None:
    """Interleaved with --stages 3 (rank r holds r, r + 2, r + 4), the copy engine, against one GPU running
    the same 6 stages with 1F1B (M=6: 1F1B on one GPU needs M >= its stages)."""
    flag = graph.replace("--", "_").replace("-", "_")
    twelve = (*TINY, "--layers", "12")  # two layers a stage: the same split in both runs
    args = (*twelve, "--schedule", "interleaved", "--pp", "2", "--stages", "3", "-m", "6", "--p2p", "copy-engine",
            graph)
    ref = Run("sched_ref_1f1b_s6_m6", (*twelve, "--schedule", "1f1b", "--stages", "6", "-m", "6", "--no-graph"))
    got, want = pipeline_runs.results(Run(f"sched_interleaved3_pp2{flag}", args, nproc=2), ref)
    assert_matches(got, want, Expect(GRAPH_TOL if graph == "--graph" else 0.0, world=2, graph=graph == "--graph",
                                     transport="copy-engine"))


@pytest.mark.gpu2
@pytest.mark.parametrize("p2p,graph", [("copy-engine", "--graph"), ("nccl", "--no-graph")])
def test_zb_interleaved_four_stages_per_rank_pp2(pipeline_runs, p2p: str, graph: str) -> None:
    """zb-interleaved with --stages 4 (rank r holds r, r + 2, r + 4, r + 6) against one GPU running the same 8
    stages with zb-h1."""
    r, want = _placed("zb-interleaved", 2, p2p, graph, v=4)
    got, ref = pipeline_runs.results(r, _placed_ref("zb-interleaved", 2, v=4))
    assert_matches(got, ref, want)


@pytest.mark.gpu2
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "zb-interleaved"])
def test_zb_memory_1f1b_pp2_matches_one_gpu(pipeline_runs, schedule: str) -> None:
    """--zb-memory 1f1b (the order that holds no more microbatches than 1F1B; at these M it differs from the
    default's) over the copy engine with graphs: each stage's W still runs in microbatch order, so the one-GPU
    reference of the default order holds (1e-6, captured)."""
    placed = schedule != "zb-h1"
    r, want = (_placed if placed else _multi)(schedule, 2, "copy-engine", "--graph")
    listed = ("--zb-order", "list") if schedule == "zbv" else ()  # zbv's default order (paper) ignores --zb-memory
    r = Run(r.name + "_zb_memory_1f1b", (*r.args, "--zb-memory", "1f1b", *listed), nproc=2)
    got, ref = pipeline_runs.results(r, (_placed_ref if placed else _ref)(schedule, 2))
    assert_matches(got, ref, want)


@pytest.mark.gpu4
@pytest.mark.parametrize("p2p,graph", [("copy-engine", "--graph"), ("nccl", "--no-graph")])
def test_zbv_pp4_matches_one_gpu_bitwise(pipeline_runs, p2p: str, graph: str) -> None:
    r, want = _placed("zbv", 4, p2p, graph)
    got, ref = pipeline_runs.results(r, _placed_ref("zbv", 4))
    assert_matches(got, ref, want)


@pytest.mark.gpu4
@pytest.mark.parametrize("p2p,graph", [("copy-engine", "--graph"), ("nccl", "--no-graph")])
def test_zb_interleaved_pp4_matches_one_gpu_bitwise(pipeline_runs, p2p: str, graph: str) -> None:
    """zb-interleaved with --stages 4 at pp=4 (16 stages of one layer) against one GPU running them with zb-h1."""
    r, want = _placed("zb-interleaved", 4, p2p, graph, v=4)
    got, ref = pipeline_runs.results(r, _placed_ref("zb-interleaved", 4, v=4))
    assert_matches(got, ref, want)



# A user model (tests/multiproc/models/lm_models.py: nn.Embedding, Linear + tanh body layers, a Linear head) on
# token data, one layer a stage, against one GPU running it with 1F1B (1e-5: the schedules order the sums alike
# per stage, the bound is the pipeline tests'). Zero-bubble and placed schedules over the copy engine with graphs;
# on one GPU the same schedules as streams (--stages). Eight stages take the model with six body layers.
USER_ENV = (("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "multiproc" / "models"),
                                                       os.environ.get("PYTHONPATH", "")) if p)),)
SHALLOW = ("--model", "lm_models:embedding_lm")
DEEP = ("--model", "lm_models:deep_embedding_lm", "--layers", "6")
USER_CASES = {"zb-h1-pp2": (2, SHALLOW, ("--schedule", "zb-h1", "--pp", "2")),
              "interleaved-pp2": (2, SHALLOW, ("--schedule", "interleaved", "--pp", "2", "--stages", "2")),
              "zbv-pp2": (2, SHALLOW, ("--schedule", "zbv", "--pp", "2", "--stages", "2")),
              "zb-interleaved-pp2": (2, SHALLOW, ("--schedule", "zb-interleaved", "--pp", "2", "--stages", "2")),
              "zb-h1-pp4": (4, SHALLOW, ("--schedule", "zb-h1", "--pp", "4")),
              "interleaved-pp4": (4, DEEP, ("--schedule", "interleaved", "--pp", "4", "--stages", "2")),
              "zbv-pp4": (4, DEEP, ("--schedule", "zbv", "--pp", "4", "--stages", "2"))}
USER_ONE_GPU_CASES = {"zb-h1-stages4": (SHALLOW, ("--schedule", "zb-h1", "--stages", "4")),
                      "interleaved-stages4": (SHALLOW, ("--schedule", "interleaved", "--stages", "4")),
                      "zbv-stages2": (SHALLOW, ("--schedule", "zbv", "--stages", "2")),
                      "zb-interleaved-stages8": (DEEP, ("--schedule", "zb-interleaved", "--stages", "8"))}


@pytest.fixture(scope="module")
def user_args(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    folder = tmp_path_factory.mktemp("user-text")
    text = folder / "corpus.txt"
    text.write_text(Path(REPO / "README.md").read_text() * 4)
    return ("--hidden", "64", "--seq", "32", "--micro-batch-size", "2", "--iters", "4", "--warmup-iters", "2",
            "--dtype", "fp32", "--vocab", "512", "--data", str(text), "--data-cache", str(folder / "cache"), "-m", "4")


def _user_ref(user_args: tuple[str, ...], model: tuple[str, ...]) -> Run:
    name = "sched_user_ref" if model == SHALLOW else "sched_user_deep_ref"
    return Run(name, (*user_args, *model, "--schedule", "1f1b", "--no-graph"), env=USER_ENV)


@pytest.mark.gpu2
@pytest.mark.parametrize("case", list(USER_CASES))
def test_user_model_schedules_match_one_gpu(pipeline_runs, user_args: tuple[str, ...], case: str) -> None:
    nproc, model, flags = USER_CASES[case]
    if nproc > pipeline_runs.gpus:
        pytest.skip(f"needs {nproc} GPUs")
    run = Run(f"sched_user_{case}", (*user_args, *model, *flags, "--p2p", "copy-engine", "--graph"), nproc=nproc,
              env=USER_ENV)
    got, want = pipeline_runs.results(run, _user_ref(user_args, model))
    assert_matches(got, want, Expect(1e-5, world=nproc, graph=True, transport="copy-engine"))


@pytest.mark.parametrize("case", list(USER_ONE_GPU_CASES))
def test_user_model_one_gpu_stages_match_1f1b(pipeline_runs, user_args: tuple[str, ...], case: str) -> None:
    model, flags = USER_ONE_GPU_CASES[case]
    run = Run(f"sched_user_one_{case}", (*user_args, *model, *flags, "--graph"), env=USER_ENV)
    got, want = pipeline_runs.results(run, _user_ref(user_args, model))
    assert_matches(got, want, Expect(1e-5, graph=True))
