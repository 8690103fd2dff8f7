"""--model gpt on GPUs (launch/pipeline.py --json) against one GPU with the same model, tokens and seed: a small GPT
(4 blocks, hidden 256, 4 heads, seq 128, the default corpus's vocabulary) at pp=2 (both schedules, both transports,
tied embeddings, recomputation) on two GPUs, pp=4 and pp=2 x dp=2 on four; graph == eager and --recompute full ==
off on one GPU; and the gpt benchmark suite's records on two GPUs (checked, not timed).

Tolerances: fp32 (TF32 off for matmuls, torch's default) runs the same kernels on the same shapes per stage, so a
pipeline matches one GPU to 1e-5 relative (dp=2 sums gradients in another order: 1e-5 too), as
test_pipeline_gpu.py's; graph replays and recomputation rerun the same kernels on the same inputs: 1e-6. bf16
(autocast, 8 mantissa bits): 2e-2, the bound test_pipeline_gpu.py states for bf16.
"""

from __future__ import annotations

import math

import pytest

from tests.gpu.compare import Expect, assert_matches, read_records
from tests.gpu.jobs import REPO, Run, gpu_env, launcher, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

GPT = ("--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--micro-batch-size",
       "2", "--iters", "5", "--warmup-iters", "2")
FP32 = (*GPT, "--dtype", "fp32")
BF16 = (*GPT, "--dtype", "bf16")
FP32_TOL, SAME_KERNELS_TOL, BF16_TOL = 1e-5, 1e-6, 2e-2

REF4 = Run("gpt_ref4", (*FP32, "--no-graph", "-m", "4"))
REF8 = Run("gpt_ref8", (*FP32, "--no-graph", "-m", "8"))
BF16_REF4 = Run("gpt_bf16_ref4", (*BF16, "--no-graph", "-m", "4"))
BF16_REF8 = Run("gpt_bf16_ref8", (*BF16, "--no-graph", "-m", "8"))
# --precision bf16: bf16 weights, no autocast, the fused RoPE attention (kernels/rope.py)
PURE = (*BF16, "--precision", "bf16")
PURE_REF4 = Run("gpt_pure_ref4", (*PURE, "--no-graph", "-m", "4"))
TIED_REF4 = Run("gpt_tied_ref4", (*FP32, "--tie-embeddings", "--no-graph", "-m", "4"))

# check -> (run, reference, rtol), all on one GPU
ONE_GPU = {
    "graph_vs_eager": (Run("gpt_g1", (*FP32, "--graph", "-m", "4")), REF4, SAME_KERNELS_TOL),
    "recompute_full_vs_off": (Run("gpt_rc1", (*FP32, "--no-graph", "-m", "4", "--recompute", "full")), REF4,
                              SAME_KERNELS_TOL),
    "recompute_2_graph_vs_off": (Run("gpt_rc2g1", (*FP32, "--graph", "-m", "4", "--recompute", "2")), REF4,
                                 SAME_KERNELS_TOL),
    "bf16_graph_vs_eager": (Run("gpt_bf16_g1", (*BF16, "--graph", "-m", "4")), BF16_REF4, BF16_TOL),
    "bf16_recompute_full_graph_vs_off": (Run("gpt_bf16_rc1", (*BF16, "--graph", "-m", "4", "--recompute", "full")),
                                         BF16_REF4, BF16_TOL),
    "pure_bf16_graph_vs_eager": (Run("gpt_pure_g1", (*PURE, "--graph", "-m", "4")), PURE_REF4, BF16_TOL),
    "pure_bf16_vs_master": (PURE_REF4, BF16_REF4, BF16_TOL),
    "zb_h1_stages2_vs_1f1b": (Run("gpt_zb_s2", (*FP32, "--no-graph", "-m", "4", "--schedule", "zb-h1", "--stages",
                                                "2")), REF4, FP32_TOL),
    # --zb-order: zbv's two stages as streams of one GPU in the searched and the paper's orders, captured
    "zbv_stages2_searched_graph_vs_1f1b": (Run("gpt_zbv_s2_searched", (*FP32, "--graph", "-m", "4", "--schedule",
                                                                      "zbv", "--stages", "2", "--zb-order",
                                                                      "searched")), REF4, FP32_TOL),
    "zbv_stages2_paper_graph_vs_1f1b": (Run("gpt_zbv_s2_paper", (*FP32, "--graph", "-m", "4", "--schedule", "zbv",
                                                                "--stages", "2", "--zb-order", "paper")), REF4,
                                        FP32_TOL),
}

# pp=2 check -> (flags, reference, rtol, transport)
PP2 = {
    "1f1b-copy-engine-graph": (("--schedule", "1f1b", "--p2p", "copy-engine", "--graph"), REF4, FP32_TOL,
                               "copy-engine"),
    "1f1b-copy-engine-no-graph": (("--schedule", "1f1b", "--p2p", "copy-engine", "--no-graph"), REF4, FP32_TOL,
                                  "copy-engine"),
    "gpipe-nccl-graph": (("--schedule", "gpipe", "--p2p", "nccl", "--graph"), REF4, FP32_TOL, "nccl"),
    "1f1b-graph-recompute-full": (("--schedule", "1f1b", "--graph", "--recompute", "full"), REF4, FP32_TOL, ""),
    "1f1b-graph-tied": (("--schedule", "1f1b", "--graph", "--tie-embeddings"), TIED_REF4, FP32_TOL, ""),
    "bf16-1f1b-graph": (("--schedule", "1f1b", "--graph", "--dtype", "bf16"), BF16_REF4, BF16_TOL, ""),
    "pure-bf16-1f1b-graph": (("--schedule", "1f1b", "--graph", "--dtype", "bf16", "--precision", "bf16"),
                             PURE_REF4, BF16_TOL, "copy-engine"),
    "zb-h1-copy-engine-graph-tied-recompute": (("--schedule", "zb-h1", "--graph", "--tie-embeddings", "--recompute",
                                                "full"), TIED_REF4, FP32_TOL, "copy-engine"),
    "zb-h1-nccl-no-graph": (("--schedule", "zb-h1", "--p2p", "nccl", "--no-graph"), REF4, FP32_TOL, "nccl"),
    "zbv-copy-engine-graph": (("--schedule", "zbv", "--stages", "2", "--graph"), REF4, FP32_TOL, "copy-engine"),
    "interleaved-graph": (("--schedule", "interleaved", "--stages", "2", "--graph"), REF4, FP32_TOL, ""),
    "pure-bf16-zb-h1-graph": (("--schedule", "zb-h1", "--graph", "--dtype", "bf16", "--precision", "bf16"),
                              PURE_REF4, BF16_TOL, "copy-engine"),
    # --zb-memory 1f1b: the zero-bubble orders that hold no more microbatches than 1F1B (other orders at M=4)
    "zb-h1-zb-memory-1f1b-graph": (("--schedule", "zb-h1", "--graph", "--zb-memory", "1f1b"), REF4, FP32_TOL,
                                   "copy-engine"),
    "zbv-zb-memory-1f1b-graph": (("--schedule", "zbv", "--stages", "2", "--graph", "--zb-memory", "1f1b",
                                  "--zb-order", "list"), REF4, FP32_TOL, "copy-engine"),  # paper ignores --zb-memory
    "zbv-zb-order-list-graph": (("--schedule", "zbv", "--stages", "2", "--graph", "--zb-order", "list"), REF4,
                                 FP32_TOL, "copy-engine"),
    # zb-interleaved: 3 stages per rank over the 6 flat layers (embedding, 4 blocks, head)
    "zb-interleaved-stages3-graph": (("--schedule", "zb-interleaved", "--stages", "3", "--graph"), REF4, FP32_TOL,
                                     "copy-engine"),
    "pure-bf16-zb-interleaved-stages3-graph": (("--schedule", "zb-interleaved", "--stages", "3", "--graph",
                                                "--dtype", "bf16", "--precision", "bf16"), PURE_REF4, BF16_TOL,
                                               "copy-engine"),
}

# four-GPU grid -> (flags, dp); pp=2 x dp=2 runs M=4 per replica, pp=4 runs M=8: both against REF8
GRIDS = {"pp4": (("--pp", "4", "-m", "8"), 1), "pp2dp2": (("--pp", "2", "--dp", "2", "-m", "4"), 2)}

# zero-bubble GPT on four GPUs (the copy engine, graphs) -> (run, reference); zbv's 8 stages need 6 blocks
FP32_L6 = (*FP32, "--layers", "6")
ZB4 = {"zb-h1": (Run("gpt_pp4_zb_h1", (*FP32, "--pp", "4", "-m", "8", "--schedule", "zb-h1", "--graph"), nproc=4),
                 REF8),
       "zbv": (Run("gpt_pp4_zbv", (*FP32_L6, "--pp", "4", "--stages", "2", "-m", "8", "--schedule", "zbv", "--graph"),
                   nproc=4), Run("gpt_l6_ref8", (*FP32_L6, "--no-graph", "-m", "8"))),
       "zb-interleaved": (Run("gpt_pp4_zbi", (*FP32_L6, "--pp", "4", "--stages", "2", "-m", "8", "--schedule",
                                              "zb-interleaved", "--graph"), nproc=4),
                          Run("gpt_l6_ref8", (*FP32_L6, "--no-graph", "-m", "8")))}


def graph_flag(args: tuple[str, ...]) -> bool | None:
    """The graph state a run's flags ask for (None: the default, graphs on a GPU)."""
    return True if "--graph" in args else False if "--no-graph" in args else None


@pytest.mark.parametrize("check", list(ONE_GPU))
def test_gpt_one_gpu(pipeline_runs, check: str) -> None:
    got_run, ref_run, rtol = ONE_GPU[check]
    got, ref = pipeline_runs.results(got_run, ref_run)
    assert_matches(got, ref, Expect(rtol, graph=graph_flag(got_run.args)))


@pytest.mark.gpu2
@pytest.mark.parametrize("combo", list(PP2))
def test_gpt_pp2_matches_one_gpu(pipeline_runs, combo: str) -> None:
    flags, ref_run, rtol, transport = PP2[combo]
    base = GPT if "--dtype" in flags else FP32
    got, ref = pipeline_runs.results(Run(f"gpt_pp2_{combo}", (*base, "--pp", "2", "-m", "4", *flags), nproc=2),
                                     ref_run)
    assert_matches(got, ref, Expect(rtol, world=2, graph=graph_flag(flags), transport=transport))


@pytest.mark.gpu4
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_gpt_grid_matches_one_gpu(pipeline_runs, grid: str, graph: str) -> None:
    flags, dp = GRIDS[grid]
    r = Run(f"gpt_{grid}{graph.replace('--', '_').replace('-', '_')}", (*FP32, *flags, graph), nproc=4)
    got, ref = pipeline_runs.results(r, REF8)
    assert_matches(got, ref, Expect(FP32_TOL, world=4, dp=dp, graph=graph == "--graph"))


@pytest.mark.gpu4
@pytest.mark.parametrize("grid", list(GRIDS))
def test_gpt_grid_bf16_matches_one_gpu(pipeline_runs, grid: str) -> None:
    flags, dp = GRIDS[grid]
    got, ref = pipeline_runs.results(Run(f"gpt_bf16_{grid}", (*BF16, *flags, "--graph"), nproc=4), BF16_REF8)
    assert_matches(got, ref, Expect(BF16_TOL, world=4, dp=dp, graph=True))


# two anchor schedules (one that allows compiled blocks, one that splits the backward) keep inductor's compiles few
SUITE_SHORT = ["--gpt-configs", "compute", "--gpt-layers", "4", "--gpt-hidden", "512", "--gpt-heads", "8",
               "--gpt-seq", "256", "--gpt-microbatches", "4", "--gpt-recompute", "--gpt-iters", "2", "--reps", "2",
               "--warmup", "1", "--gpt-anchor-schedules", "1f1b,zbv"]


@pytest.mark.gpu2
def test_gpt_suite_records_on_two_gpus(gpu_out) -> None:
    """The gpt suite on a shrunk compute configuration: the anchor's candidates (the plain torch GPT, blocks eager
    and compiled), peerline's GPT under torch, peerline eager and graph with MFU, and the recompute table with peak
    memory, all finite; peerline's losses near its own model's under torch with autocast, and near the plain
    model's (another init of the same shape)."""
    res = gpu_out / "bench_gpt_pp2"
    cmd = [*launcher(2), str(REPO / "launch" / "bench.py"), "gpt", *SUITE_SHORT, "--out", str(res)]
    rc, tail = run(cmd, gpu_out / "bench_gpt_pp2.log", 300, gpu_env())
    assert rc == 0, outcome("gpt suite pp=2", rc, tail, 300)
    by_case = {r["case"]: r for r in read_records(res / "results.jsonl")}
    half = by_case["compute-bound graph"]["extra"]["stage_layers"] // 2
    wanted = ["compute-bound torch-peerline-gpt", "compute-bound eager", "compute-bound graph",
              "compute-bound graph MFU",
              *(f"compute-bound recompute {s} {what}" for s in (str(half), "full") for what in ("time", "peak memory"))]
    missing = [c for c in wanted if c not in by_case]
    assert not missing, (missing, sorted(by_case))
    for case in wanted:
        ratio = by_case[case]["ratio"]
        assert ratio is not None and math.isfinite(ratio) and ratio > 0, (case, ratio)
    graph = by_case["compute-bound graph"]["extra"]
    assert graph["mfu"] is not None and 0 < graph["mfu"] < 100, graph["mfu"]
    assert len(graph["peak_mem_gb_per_rank"]) == 2 and min(graph["peak_mem_gb_per_rank"]) > 0
    assert graph["anchor_model"] == "plain torch GPT", graph["anchor_model"]
    assert {"1f1b autocast compiled", "1f1b bf16-params compiled", "zbv autocast eager"} <= set(
        graph["anchor_candidates"]), graph["anchor_candidates"]
    assert not any(k.startswith("zbv") and k.endswith("compiled") for k in graph["anchor_candidates"])
    for name, cand in graph["anchor_candidates"].items():  # the plain model: its own init, the same shape
        assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(graph["losses"], cand["losses"])), (name, cand)
    under_torch = by_case["compute-bound torch-peerline-gpt"]["extra"]
    autocast = {k: v for k, v in under_torch["candidates"].items() if " autocast " in k}
    assert autocast, under_torch["candidates"]
    for name, cand in autocast.items():  # same fp32 weights and bf16 autocast: close, not equal
        assert all(abs(a - b) <= BF16_TOL * abs(b) for a, b in zip(graph["losses"], cand["losses"])), (name, cand)
    full = by_case["compute-bound recompute full peak memory"]
    assert full["peerline"] < full["anchor"], full  # recomputing every layer holds less at its peak than off


@pytest.mark.gpu4
@pytest.mark.parametrize("schedule", list(ZB4))
def test_gpt_zero_bubble_pp4_matches_one_gpu(pipeline_runs, schedule: str) -> None:
    run, ref_run = ZB4[schedule]
    got, ref = pipeline_runs.results(run, ref_run)
    assert_matches(got, ref, Expect(FP32_TOL, world=4, graph=True))
