"""Benchmark suite `pipeline`: one full training iteration of the same model, data and microbatching under
(a) peerline eager and (b) peerline with whole-iteration CUDA graphs, each schedule, against (c)
torch.distributed.pipelining (+ DDP on the replicas) at its best: iterations/s, tokens/s, their ratios, and each
one's distance to the ideal time.

    torchrun --nproc_per_node=2 launch/bench.py pipeline [--pipeline-configs compute,launch] [--schedules 1f1b]
        [--variants torch,eager,graph] [--dp 1] [--pipeline-iters 5] [--pipeline-timeline]
        [--pipeline-anchor-schedules 1f1b,zbv] [--pipeline-anchor-recipes bf16-params]
        [--pipeline-precisions master,bf16] [--pipeline-zb-orders list,paper]

The anchor, measured once per configuration, is torch's fastest (schedule, precision recipe): every torch schedule
that applies (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; with dp > 1 those of
one stage per rank) under bf16 parameters and under fp32 parameters + bf16 autocast (fp32 shapes: fp32), shared
with the gpt suite (bench/suites/torch_schedules.py). Every peerline (schedule, variant) is recorded against it,
and `<configuration> best` records peerline's fastest against it, each naming what won. `--pipeline-precisions`
runs each peerline variant under several --precision recipes (default master; bf16 is torch's bf16-parameter recipe:
bf16 AdamW state, no fp32 masters); a recipe other than master is named in the case, e.g. `compute zbv graph bf16`.
`--pipeline-zb-orders` does the same with --zb-order for zbv and zb-interleaved (`compute zbv graph bf16
zb-order-paper`), so the rank orders are compared against one anchor in one run.

The anchor's model is the default residual MLP written in plain PyTorch (bench/suites/plain_mlp.py: nn.Linear
with its bias, F.gelu), holding peerline's initial weights.

Configurations (bf16 autocast, AdamW, MSE on synthetic targets):
  compute  16 blocks of h=2048, micro-batch 8x512 tokens, M=8   (GEMM-bound: headroom is the bubble and fusion)
  compute16  the same at M=16 (a smaller bubble: 1F1B's idle share falls from (p-1)/(M+p-1))
  launch   32 blocks of h=512,  micro-batch 2x256 tokens, M=16  (host-launch-bound: graphs should win big)
  mid      24 blocks of h=1024, micro-batch 4x512 tokens, M=12  (between the two; the eager suite's second shape)
  quick    4 blocks of h=32, micro-batch 2x8, M=4, fp32          (--quick: the CPU smoke test)

Timing (benchkit.time_blocks): blocks of --pipeline-iters iterations with no host sync inside, all ranks started
together, the slowest rank's time per iteration; median over --reps blocks after --warmup blocks. Before timing,
the first two iterations' losses of every variant are read and compared with the anchor's (same weights, same
data: they agree to rounding in fp32). The ideal time of each variant comes from its own stages' forward and
backward times measured alone (bench/ideal.py). The bubble-free time (--pipeline-bubble-free, on by default, pp > 1;
bench/suites/bubble_free.py) is the whole model on one GPU, 1F1B in one stage, with the fastest variant's recipe
and graph setting, in a fresh process on rank 0's GPU, divided by pp: `<configuration> best vs bubble-free` is the
fastest variant's fraction of it (goal >= 0.95 on a GPU).

Every measurement goes through runtime_timing.measure_or_note, so with --isolate (bench/isolation.py) each one
(the anchor with its candidates, each peerline variant) runs as a job of its own and the others replay its result.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record, Timing
from peerline.bench.ideal import SPLIT, IdealReport, stages_per_rank
from peerline.bench.runtime_timing import (
    BlockTimer,
    Measured,
    free_device,
    measure_or_note,
    open_runtime,
    peak_gb,
    time_anchor,
    time_captured,
)
from peerline.bench.suites import bubble_free
from peerline.bench.suites.torch_pipelining import PipeShape, TorchPipelineAnchor, build_stage_module, measure_stage_ms
from peerline.bench.suites.torch_schedules import (
    RECIPES,
    TORCH_SCHEDULES,
    candidates,
    describe_candidates,
    fastest,
    param_dtype,
    recipes_for,
)
from peerline.choices import DEFAULT_ZB_ORDER, PRECISIONS, SCHEDULES, ZB_ORDERS

log = logging.getLogger(__name__)

SUITE = "pipeline"
CONFIGS = {
    "compute": PipeShape("compute-bound", layers=16, hidden=2048, micro_batch_size=8, seq=512, microbatches=8,
                         dtype="bf16"),
    "compute16": PipeShape("compute-bound M=16", layers=16, hidden=2048, micro_batch_size=8, seq=512,
                           microbatches=16, dtype="bf16"),
    "launch": PipeShape("launch-bound", layers=32, hidden=512, micro_batch_size=2, seq=256, microbatches=16,
                        dtype="bf16"),
    "mid": PipeShape("mid", layers=24, hidden=1024, micro_batch_size=4, seq=512, microbatches=12, dtype="bf16"),
    "quick": PipeShape("quick", layers=4, hidden=32, micro_batch_size=2, seq=8, microbatches=4, dtype="fp32"),
}
VARIANTS = ("torch", "eager", "graph")
#: goals: peerline's fastest (schedule, variant) vs torch's fastest (schedule, recipe), tokens/s, on a GPU
GOALS = {"compute-bound": 1.08, "compute-bound M=16": 1.08, "launch-bound": 3.0}
LOSS_CHECK_ITERS = 2


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pipeline-configs", type=_csv, default=None,
                       help="comma-separated: compute, launch, mid, quick (default compute,launch; quick with --quick)")
    group.add_argument("--schedules", type=_csv, default=None,
                       help=f"any of {','.join(SCHEDULES)} (default all; interleaved and zbv with 2 stages per rank, "
                       "zb-interleaved with 4 or 3 where the layers split evenly, else 2)")
    group.add_argument("--variants", type=_csv, default=None, help="torch,eager,graph (default all)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (pp = world size / dp)")
    group.add_argument("--pipeline-iters", type=int, default=None, help="iterations per timed block (default 5)")
    group.add_argument("--pipeline-timeline", action="store_true",
                       help="also draw one peerline eager iteration per configuration (PNG + Chrome trace)")
    group.add_argument("--pipeline-anchor-schedules", type=_csv, default=None,
                       help=f"the anchor's torch schedules to try: {','.join(TORCH_SCHEDULES)} (default all that "
                            "apply)")
    group.add_argument("--pipeline-precisions", type=_csv, default=None,
                       help="peerline's --precision recipes for the eager and graph variants: master, bf16 (torch's "
                            "bf16-parameter recipe), compact, autocast, e.g. master,bf16 (default master); those that "
                            "need bf16 weights are skipped, with a note, on an fp32 shape")
    group.add_argument("--pipeline-zb-orders", type=_csv, default=None,
                       help=f"peerline's --zb-order for zbv and zb-interleaved: {','.join(ZB_ORDERS)}, e.g. list,paper "
                            f"(default {DEFAULT_ZB_ORDER}, the run's); each multiplies those schedules' variants, "
                            "measured against the same anchor")
    group.add_argument("--pipeline-bubble-free", action=argparse.BooleanOptionalAction, default=True,
                       help="also time the whole model on one GPU (rank 0's, a fresh process) with peerline's fastest "
                            "variant's recipe: the bubble-free time, / pp, and the fastest variant's fraction of it "
                            "(pp > 1; default on)")
    group.add_argument("--pipeline-anchor-recipes", type=_csv, default=None,
                       help=f"the anchor's precision recipes to try: {','.join(RECIPES[:2])} for bf16 shapes "
                            "(default both), fp32 for fp32 shapes")


def _ideal(schedule: str, shape: PipeShape, pp: int, mine: tuple[int, int, float, float], achieved_ms: float
           ) -> IdealReport:
    """Gather (stage, replica, fwd, bwd) from every rank; the bound of replica 0's stages."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_stage = {st: (f, b) for st, rep, f, b in everyone if rep == 0}
    fwd = tuple(by_stage[s][0] for s in range(pp))
    bwd = tuple(by_stage[s][1] for s in range(pp))
    return IdealReport(schedule, shape.microbatches, fwd, bwd, achieved_ms)


def _anchor_name(anchor: Measured, dp: int) -> str:
    return (f"torch.distributed.pipelining {anchor.extra['schedule']} {anchor.extra['recipe']}"
            + (" + DDP" if dp > 1 else ""))


class TorchAnchor:
    """The anchor of one configuration on this grid: torch.distributed.pipelining's fastest (schedule, recipe)."""

    def __init__(self, args: argparse.Namespace, ctx: BenchContext, shape: PipeShape, pp: int, dp: int,
                 groups: tuple[Any, Any]) -> None:
        self.args, self.ctx, self.shape, self.pp, self.dp, self.groups = args, ctx, shape, pp, dp, groups
        self.device, self.rank = ctx.device, dist.get_rank()
        self._time = BlockTimer.from_args(args, ctx.quick, self.device, getattr(args, "pipeline_iters", None))
        self.stage_warmup, self.stage_reps = (1, 2) if ctx.quick else (3, 10)

    def candidates(self) -> list[tuple[str, str]]:
        """(schedule, recipe) pairs to try: --pipeline-anchor-schedules x --pipeline-anchor-recipes, those that
        apply to the shape (the others noted)."""
        s, what = self.shape, f"pipeline {self.shape.name}"
        fits = recipes_for(s.dtype)
        recipes = getattr(self.args, "pipeline_anchor_recipes", None) or fits
        unknown = [r for r in recipes if r not in RECIPES]
        if unknown:
            raise ValueError(f"{what}: unknown precision recipe {unknown[0]!r}; choose from {', '.join(RECIPES)}")
        for r in [r for r in recipes if r not in fits]:
            self.ctx.note(f"{what}: recipe {r} does not apply to a {s.dtype} shape; not tried")
        return candidates(getattr(self.args, "pipeline_anchor_schedules", None), [r for r in recipes if r in fits],
                          self.pp, s.layers, s.microbatches, self.dp, self.ctx.note, what=what)

    def measure(self, failures: list[str]) -> Measured | str:
        """Every candidate timed; the fastest, with its ideal time when it holds one stage per rank."""
        s = self.shape
        measured, best = fastest(self.ctx, f"{s.name} torch", self.candidates(), self._one, failures)
        if best is None:
            return "no anchor candidate ran"
        self.ctx.note(f"pipeline {s.name} pp={self.pp} dp={self.dp}: torch.distributed.pipelining candidates "
                      f"(ms/iter): {describe_candidates(measured, best)}")
        best.ideal = self._ideal(best)
        return best

    def _one(self, schedule: str, recipe: str) -> Measured:
        dtype = param_dtype(recipe) if recipe == "bf16-params" else None
        anchor = TorchPipelineAnchor(self.shape, schedule, self.pp, self.dp, self.rank, self.device,
                                     pp_group=self.groups[0], dp_group=self.groups[1], param_dtype=dtype)
        losses, timing = time_anchor(anchor, LOSS_CHECK_ITERS, self._time)
        return Measured(f"torch {schedule} {recipe}", timing, losses, None, peak_gb(self.device))

    def _ideal(self, best: Measured) -> IdealReport | None:
        """The winner's ideal time from its stages' forward and backward measured alone (one stage per rank)."""
        schedule = best.extra["schedule"]
        if TORCH_SCHEDULES[schedule].per_rank != 1 or schedule not in SCHEDULES:
            return None
        stage = self.rank % self.pp
        dtype = param_dtype(best.extra["recipe"]) if best.extra["recipe"] == "bf16-params" else None
        module = build_stage_module(self.shape, self.pp, stage).to(self.device, dtype=dtype)
        f, b = measure_stage_ms(module, self.shape, self.device, stage == 0, stage == self.pp - 1,
                                warmup=self.stage_warmup, reps=self.stage_reps)
        return _ideal(schedule, self.shape, self.pp, (stage, self.rank // self.pp, f, b), best.timing.median_ms)


class PipelineBench:
    """Runs the peerline variants of one (configuration, schedule) on this rank."""

    def __init__(self, args: argparse.Namespace, ctx: BenchContext, shape: PipeShape, schedule: str, dp: int
                 ) -> None:
        self.args, self.ctx, self.shape, self.schedule, self.dp = args, ctx, shape, schedule, dp
        self.device = ctx.device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.pp = self.world // dp
        quick = ctx.quick
        self._time = BlockTimer.from_args(args, quick, self.device, getattr(args, "pipeline_iters", None))
        self.draw_timeline = bool(getattr(args, "pipeline_timeline", False))
        self.stage_warmup, self.stage_reps = (1, 2) if quick else (3, 10)

    @property
    def tokens(self) -> int:
        s = self.shape
        return s.microbatches * s.micro_batch_size * s.seq * self.dp

    # -- (a), (b) peerline -------------------------------------------------------------------------------------
    def peerline(self, graph: bool, precision: str = "master", order: str = DEFAULT_ZB_ORDER) -> Measured | str:
        """Measured (named by variant_label), or why the variant could not run; `order`: --zb-order."""
        try:
            from peerline.distributed.config import RunConfig
        except ImportError as exc:
            return f"peerline runtime not available ({exc})"
        s = self.shape
        cfg = RunConfig(dp=self.dp, schedule=self.schedule,
                        stages=stages_per_rank(self.schedule, self.pp, s.layers),
                        microbatches=s.microbatches,
                        micro_batch_size=s.micro_batch_size, seq=s.seq, hidden=s.hidden, layers=s.layers,
                        seed=s.seed, lr=s.lr, dtype=s.dtype, precision=precision, device=self.device.type,
                        graph=graph, iters=10**9, log_every=1, zb_order=order)
        with open_runtime(cfg) as rt:
            measured = time_captured(rt, graph, LOSS_CHECK_ITERS, self._time)
            if isinstance(measured, str):
                return measured
            losses, timing = measured
            peak = peak_gb(self.device)
            extra: dict[str, Any] = {"transport": rt.transport_name}
            if not graph and self.draw_timeline:
                extra["timeline"] = self._timeline(rt)
            ideal = self._peerline_ideal(rt, timing)
        extra["precision"] = precision
        extra["zb_order"] = order
        return Measured(variant_label(graph, precision, order), timing, losses, ideal, peak, extra)

    def _peerline_ideal(self, rt, timing: Timing) -> IdealReport | None:
        if len(rt.engine.stages) != 1:
            return None  # stages as streams of one device: the bound of pp x stages is not measured here
        stage = next(iter(rt.engine.stages.values()))
        f, b = measure_stage_ms(stage.module, self.shape, self.device, stage.is_first, stage.is_last,
                                warmup=self.stage_warmup, reps=self.stage_reps, stream=stage.stream)
        return _ideal(self.schedule, self.shape, self.pp, (rt.mesh.stage, rt.mesh.replica, f, b), timing.median_ms)

    def _timeline(self, rt) -> str:
        """Record one eager iteration, gather it to rank 0, draw it, check its dependencies."""
        from peerline.distributed.observe.timeline_check import check_spans
        from peerline.distributed.observe.timeline_draw import write_timeline

        tl = rt.engine.timeline
        tl.enabled = True
        rt.train(rt.iteration + 1)
        spans = tl.gather()
        tl.enabled = False
        if spans is None:
            return ""
        stem = Path(self.ctx.out_dir) / f"timeline-{self.shape.name}-{self.schedule}"
        paths = write_timeline(spans, stem, title=f"peerline eager, {self.shape.name}, {self.schedule}, "
                                                  f"pp={self.pp} dp={self.dp}, M={self.shape.microbatches}")
        errors = check_spans(spans, pp=self.pp, tol_ms=0.05)
        n = sum(len(v) for v in spans.values())
        if n == 0:
            errors = ["no spans were recorded"]
        verdict = f"{n} spans, consistent" if not errors else f"{len(errors)} problems, first: {errors[0]}"
        self.ctx.note(f"timeline {self.shape.name} {self.schedule}: {', '.join(map(str, paths))}: {verdict}")
        return verdict

    # -- report ------------------------------------------------------------------------------------------------
    @property
    def _sizes(self) -> dict[str, Any]:
        return {**self.shape.sizes(), "pp": self.pp, "dp": self.dp, "schedule": self.schedule,
                "tokens_per_iter": self.tokens}

    def report_variant(self, name: str, results: dict[str, Measured]) -> None:
        """Record a peerline variant against the anchor as soon as both are measured (a later hang keeps it)."""
        s, ctx = self.shape, self.ctx
        m, anchor = results[name], results.get("torch")
        if m.ideal is not None:
            ctx.note(f"{s.name} {self.schedule} {m.name}: {m.ideal.describe()}")
        if name == "torch" or anchor is None:
            return
        loss_diff = max((abs(a - b) for a, b in zip(m.losses, anchor.losses, strict=False)), default=math.nan)
        extra = {
            "ms_per_iter": m.timing.median_ms, "anchor_ms_per_iter": anchor.timing.median_ms,
            "iters_per_s": 1e3 / m.timing.median_ms, "anchor_iters_per_s": 1e3 / anchor.timing.median_ms,
            "spread": m.timing.spread, "anchor_spread": anchor.timing.spread,
            "peak_gb": m.peak_gb, "anchor_peak_gb": anchor.peak_gb,
            "losses": m.losses, "anchor_losses": anchor.losses, "max_loss_diff": loss_diff,
            "ideal": m.ideal.as_dict() if m.ideal else None,
            "anchor_ideal": anchor.ideal.as_dict() if anchor.ideal else None,
            "anchor_schedule": anchor.extra["schedule"], "anchor_recipe": anchor.extra["recipe"], **m.extra,
        }
        ctx.record(Record(SUITE, f"{s.name} {self.schedule} {name}", "tokens/s", m.tokens_per_s(self.tokens),
                          anchor.tokens_per_s(self.tokens), _anchor_name(anchor, self.dp), sizes=self._sizes,
                          extra=extra))

    def report_ideal(self, results: dict[str, Measured]) -> None:
        """The fastest peerline variant against its bubble-aware bound."""
        anchor = results.get("torch")
        best = min((m for n, m in results.items() if n != "torch"), key=lambda m: m.timing.median_ms, default=None)
        if best is None or best.ideal is None:
            return
        self.ctx.record(Record(SUITE, f"{self.shape.name} {self.schedule} {best.name} vs ideal", "ms/iter",
                               best.timing.median_ms, best.ideal.bound_ms, "bubble bound (M+P-1) x max(fwd+bwd)",
                               higher_is_better=False, sizes=self._sizes,
                               extra={"ideal": best.ideal.as_dict(),
                                      "anchor_ratio_to_bound": anchor.ideal.ratio if anchor and anchor.ideal
                                      else None}))


def variant_label(graph: bool, precision: str, order: str = DEFAULT_ZB_ORDER) -> str:
    """A peerline variant's name in the cases: eager or graph, then its --precision where it is not master and its
    --zb-order where it is not the run's default."""
    return (("graph" if graph else "eager") + ("" if precision == "master" else f" {precision}")
            + ("" if order == DEFAULT_ZB_ORDER else f" zb-order-{order}"))


def _precisions_for(shape: PipeShape, precisions: list[str], note) -> list[str]:
    """The recipes that apply to `shape`: bf16 and compact keep bf16 weights and need a bf16 shape."""
    fits = [p for p in precisions if shape.dtype == "bf16" or p not in ("bf16", "compact")]
    for p in precisions:
        if p not in fits:
            note(f"pipeline {shape.name}: --precision {p} keeps bf16 weights, and this shape is {shape.dtype}; "
                 "not run")
    return fits


def _groups(pp: int, dp: int, rank: int) -> tuple[Any, Any]:
    """(pp group, dp group) of this rank for the anchor; (None, None) when the world is one pipeline."""
    if dp == 1:
        return None, None
    pp_group = dp_group = None
    for stage in range(pp):
        g = dist.new_group([r * pp + stage for r in range(dp)])
        if stage == rank % pp:
            dp_group = g
    for replica in range(dp):
        g = dist.new_group([replica * pp + s for s in range(pp)])
        if replica == rank // pp:
            pp_group = g
    return pp_group, dp_group


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Every (configuration, schedule) x variant; see the module docstring."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = getattr(args, "dp", 1) or 1
    if dp < 1 or world % dp:
        raise ValueError(f"pipeline: --dp {dp} does not divide the world size {world}")
    configs = getattr(args, "pipeline_configs", None) or (["quick"] if ctx.quick else ["compute", "launch"])
    schedules = getattr(args, "schedules", None) or list(SCHEDULES)
    variants = getattr(args, "variants", None) or list(VARIANTS)
    precisions = list(dict.fromkeys(getattr(args, "pipeline_precisions", None) or ["master"]))
    orders = list(dict.fromkeys(getattr(args, "pipeline_zb_orders", None) or [DEFAULT_ZB_ORDER]))
    for bad, allowed, what in ((configs, CONFIGS, "configuration"), (schedules, SCHEDULES, "schedule"),
                               (variants, VARIANTS, "variant"), (precisions, PRECISIONS, "precision"),
                               (orders, ZB_ORDERS, "zb order")):
        unknown = [v for v in bad if v not in allowed]
        if unknown:
            raise ValueError(f"pipeline: unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    variants = sorted(set(variants), key=VARIANTS.index)  # the anchor first: each variant is recorded against it
    if getattr(args, "pipeline_timeline", False) and "eager" not in variants:
        # The timeline is drawn from an eager iteration's events; without one the run would end with nothing drawn.
        raise ValueError("pipeline: --pipeline-timeline draws an eager iteration: add eager to --variants")
    if ctx.device.type != "cuda" and "graph" in variants:
        variants = [v for v in variants if v != "graph"]
        ctx.note("pipeline: no CUDA: the graph variant is skipped")
    if not ctx.quick and ctx.device.type != "cuda":
        ctx.note("pipeline: the full configurations on the CPU take long; use --quick for a smoke test")
    pp = world // dp
    groups = _groups(pp, dp, rank)
    ctx.facts.setdefault("pipeline_grid", f"pp={pp} x dp={dp}")
    failures: list[str] = []
    for key in configs:
        shape = CONFIGS[key]
        fastest = run_configuration(args, ctx, shape, schedules, variants, _precisions_for(shape, precisions, ctx.note),
                                    dp, groups, failures, orders)
        if fastest is not None and pp > 1 and getattr(args, "pipeline_bubble_free", True):
            _bubble_free(args, ctx, key, pp, dp, fastest, failures)
    if failures:
        raise RuntimeError(f"{len(failures)} pipeline variant(s) failed: " + " | ".join(failures))


def _bubble_free(args: argparse.Namespace, ctx: BenchContext, key: str, pp: int, dp: int,
                 fastest: tuple[str, Measured], failures: list[str]) -> None:
    """The whole model of configuration `key` on one GPU (bench/suites/bubble_free.py) and the fastest variant's
    fraction of that time / pp."""
    shape = CONFIGS[key]
    one = measure_or_note(ctx, SUITE, f"{shape.name} one GPU (bubble-free)",
                          lambda: bubble_free.measure(args, ctx, key, shape, fastest[1]), failures)
    if isinstance(one, Measured):
        bubble_free.record(ctx, shape, pp, dp, *fastest, one)


def run_configuration(args: argparse.Namespace, ctx: BenchContext, shape: PipeShape, schedules: list[str],
                      variants: list[str], precisions: list[str], dp: int, groups: tuple[Any, Any],
                      failures: list[str], orders: tuple[str, ...] | list[str] = (DEFAULT_ZB_ORDER,)
                      ) -> tuple[str, Measured] | None:
    """The anchor once (torch's fastest), then every peerline (schedule, variant, precision, and for zbv and
    zb-interleaved each of `orders`) against it, then peerline's fastest against it; returns that fastest (its label
    and measurement), None when none ran."""
    pp = dist.get_world_size() // dp
    anchor: Measured | None = None
    if "torch" in variants:
        got = measure_or_note(ctx, SUITE, f"{shape.name} torch",
                              lambda: TorchAnchor(args, ctx, shape, pp, dp, groups).measure(failures), failures)
        anchor = got if isinstance(got, Measured) else None
        if anchor is None:
            ctx.note(f"pipeline {shape.name}: no anchor (torch.distributed.pipelining failed or did not run, see "
                     "above): the peerline variants get no ratio records, only their ideal-time ones")
        if anchor is not None and anchor.ideal is not None:
            ctx.note(f"{shape.name} torch {anchor.extra['schedule']} {anchor.extra['recipe']}: "
                     f"{anchor.ideal.describe()}")
    fastest_peerline: dict[str, Measured] = {}
    for schedule in schedules:
        bench = PipelineBench(args, ctx, shape, schedule, dp)
        results: dict[str, Measured] = {"torch": anchor} if anchor is not None else {}
        runs = [(v == "graph", p, o) for v in variants if v != "torch" for p in precisions
                for o in (orders if schedule in SPLIT else [DEFAULT_ZB_ORDER])]
        for graph, precision, order in runs:
            variant = variant_label(graph, precision, order)
            got = measure_or_note(ctx, SUITE, f"{shape.name} {schedule} {variant}",
                                  lambda g=graph, p=precision, o=order, bench=bench: bench.peerline(g, p, o),
                                  failures)
            if not isinstance(got, Measured):
                continue
            results[variant] = fastest_peerline[f"{schedule} {variant}"] = got
            bench.report_variant(variant, results)
            if ctx.is_writer:
                log.info("pipeline %s %s %s: %.3f ms/iter (spread %.2f), %.0f tokens/s, losses %s",
                         shape.name, schedule, variant, got.timing.median_ms, got.timing.spread,
                         got.tokens_per_s(bench.tokens), ", ".join(f"{v:.6g}" for v in got.losses))
        bench.report_ideal(results)
        free_device(ctx.device)
    fastest = min(fastest_peerline.items(), key=lambda kv: kv[1].timing.median_ms, default=None)
    report_best(ctx, shape, pp, dp, anchor, fastest_peerline, fastest)
    return fastest


def report_best(ctx: BenchContext, shape: PipeShape, pp: int, dp: int, anchor: Measured | None,
                peerline: dict[str, Measured], fastest: tuple[str, Measured] | None) -> None:
    """`<configuration> best`: peerline's fastest (schedule, variant) of `peerline` (`fastest`: its label and
    measurement) against torch's fastest (schedule, recipe), each named; on a GPU, the goal line."""
    if anchor is None or fastest is None:
        return
    label, best = fastest
    tokens = shape.microbatches * shape.micro_batch_size * shape.seq * dp
    extra = {"peerline_best": label, "ms_per_iter": best.timing.median_ms,
             "anchor_ms_per_iter": anchor.timing.median_ms, "anchor_schedule": anchor.extra["schedule"],
             "anchor_recipe": anchor.extra["recipe"],
             "peerline_candidates": {k: m.timing.median_ms for k, m in peerline.items()},
             "anchor_candidates": anchor.extra.get("candidates", {})}
    rec = ctx.record(Record(SUITE, f"{shape.name} best", "tokens/s", best.tokens_per_s(tokens),
                            anchor.tokens_per_s(tokens), _anchor_name(anchor, dp),
                            sizes={**shape.sizes(), "pp": pp, "dp": dp, "schedule": label.split()[0],
                                   "tokens_per_iter": tokens}, extra=extra))
    goal = GOALS.get(shape.name)
    if goal is not None and ctx.device.type == "cuda":
        ctx.note(f"GOAL {'MET' if rec.ratio >= goal else 'MISSED'} pipeline {shape.name} best: peerline {label} "
                 f"{rec.ratio:.2f}x torch {anchor.extra['schedule']} {anchor.extra['recipe']} (goal >= {goal}x)")
