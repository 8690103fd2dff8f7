"""Benchmark suite `pipeline`: one full training iteration of the same model, data, microbatching and schedule
under (a) peerline eager, (b) peerline with whole-iteration CUDA graphs, (c) torch.distributed.pipelining
(+ DDP on the replicas): iterations/s, tokens/s, their ratios, and each one's distance to the ideal time.

    torchrun --nproc_per_node=2 launch/bench.py pipeline [--pipeline-configs compute,launch] [--schedules 1f1b]
        [--variants torch,eager,graph] [--dp 1] [--pipeline-iters 5] [--pipeline-timeline]

Configurations (bf16 autocast, AdamW, MSE on synthetic targets):
  compute  16 blocks of h=2048, micro-batch 8x512 tokens, M=8   (GEMM-bound: headroom is the bubble and fusion)
  launch   32 blocks of h=512,  micro-batch 2x256 tokens, M=16  (host-launch-bound: graphs should win big)
  mid      24 blocks of h=1024, micro-batch 4x512 tokens, M=12  (between the two; the eager suite's second shape)
  quick    4 blocks of h=32, micro-batch 2x8, M=4, fp32          (--quick: the CPU smoke test)

Timing (benchkit.time_blocks): blocks of --pipeline-iters iterations with no host sync inside, all ranks started
together, the slowest rank's time per iteration; median over --reps blocks after --warmup blocks. Before timing,
the first two iterations' losses of every variant are read and compared with the anchor's (same weights, same
data: they agree to rounding in fp32). The ideal time of each variant comes from its own stages' forward and
backward times measured alone (bench/ideal.py).
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Any

import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record, Timing
from peerline.bench.ideal import PLACED, IdealReport
from peerline.bench.runtime_timing import (
    BlockTimer,
    Measured,
    free_device,
    open_runtime,
    peak_gb,
    time_anchor,
    time_captured,
)
from peerline.bench.suites.torch_pipelining import PipeShape, TorchPipelineAnchor, measure_stage_ms
from peerline.choices import SCHEDULES

log = logging.getLogger(__name__)

SUITE = "pipeline"
CONFIGS = {
    "compute": PipeShape("compute-bound", layers=16, hidden=2048, micro_batch_size=8, seq=512, microbatches=8,
                         dtype="bf16"),
    "launch": PipeShape("launch-bound", layers=32, hidden=512, micro_batch_size=2, seq=256, microbatches=16,
                        dtype="bf16"),
    "mid": PipeShape("mid", layers=24, hidden=1024, micro_batch_size=4, seq=512, microbatches=12, dtype="bf16"),
    "quick": PipeShape("quick", layers=4, hidden=32, micro_batch_size=2, seq=8, microbatches=4, dtype="fp32"),
}
VARIANTS = ("torch", "eager", "graph")
#: goals: peerline graph vs torch 1F1B, tokens/s
GOALS = {"compute-bound": 1.08, "launch-bound": 3.0}
LOSS_CHECK_ITERS = 2


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pipeline-configs", type=_csv, default=None,
                       help="comma-separated: compute, launch, mid, quick (default compute,launch; quick with --quick)")
    group.add_argument("--schedules", type=_csv, default=None,
                       help=f"any of {','.join(SCHEDULES)} (default all; interleaved and zbv with 2 stages per rank)")
    group.add_argument("--variants", type=_csv, default=None, help="torch,eager,graph (default all)")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (pp = world size / dp)")
    group.add_argument("--pipeline-iters", type=int, default=None, help="iterations per timed block (default 5)")
    group.add_argument("--pipeline-timeline", action="store_true",
                       help="also draw one peerline eager iteration per configuration (PNG + Chrome trace)")


def _ideal(schedule: str, shape: PipeShape, pp: int, mine: tuple[int, int, float, float], achieved_ms: float
           ) -> IdealReport:
    """Gather (stage, replica, fwd, bwd) from every rank; the bound of replica 0's stages."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_stage = {st: (f, b) for st, rep, f, b in everyone if rep == 0}
    fwd = tuple(by_stage[s][0] for s in range(pp))
    bwd = tuple(by_stage[s][1] for s in range(pp))
    return IdealReport(schedule, shape.microbatches, fwd, bwd, achieved_ms)


class PipelineBench:
    """Runs every variant of one (configuration, schedule) on this rank."""

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

    # -- (c) the anchor ----------------------------------------------------------------------------------------
    def torch_anchor(self, groups: tuple[Any, Any]) -> Measured:
        anchor = TorchPipelineAnchor(self.shape, self.schedule, self.pp, self.dp, self.rank, self.device,
                                     pp_group=groups[0], dp_group=groups[1])
        losses, timing = time_anchor(anchor, LOSS_CHECK_ITERS, self._time)
        peak = peak_gb(self.device)
        f, b = measure_stage_ms(anchor.module, self.shape, self.device, anchor.is_first, anchor.is_last,
                                warmup=self.stage_warmup, reps=self.stage_reps)
        ideal = _ideal(self.schedule, self.shape, self.pp, (anchor.stage_index, anchor.replica, f, b),
                       timing.median_ms)
        return Measured("torch", timing, losses, ideal, peak)

    # -- (a), (b) peerline -------------------------------------------------------------------------------------
    def peerline(self, graph: bool) -> Measured | str:
        """Measured, or why the variant could not run."""
        try:
            from peerline.distributed.config import RunConfig
        except ImportError as exc:
            return f"peerline runtime not available ({exc})"
        s = self.shape
        cfg = RunConfig(dp=self.dp, schedule=self.schedule, stages=2 if self.schedule in PLACED else 1,
                        microbatches=s.microbatches,
                        micro_batch_size=s.micro_batch_size, seq=s.seq, hidden=s.hidden, layers=s.layers,
                        seed=s.seed, lr=s.lr, dtype=s.dtype, device=self.device.type, graph=graph,
                        iters=10**9, log_every=1)
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
        return Measured("graph" if graph else "eager", timing, losses, ideal, peak, extra)

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
        # the anchor runs torch's GPipe for gpipe and its 1F1B for every other schedule: name what ran
        torch_schedule = "gpipe" if self.schedule == "gpipe" else "1f1b"
        anchor_name = f"torch.distributed.pipelining {torch_schedule}" + (" + DDP" if self.dp > 1 else "")
        loss_diff = max((abs(a - b) for a, b in zip(m.losses, anchor.losses, strict=False)), default=math.nan)
        extra = {
            "ms_per_iter": m.timing.median_ms, "anchor_ms_per_iter": anchor.timing.median_ms,
            "iters_per_s": 1e3 / m.timing.median_ms, "anchor_iters_per_s": 1e3 / anchor.timing.median_ms,
            "spread": m.timing.spread, "anchor_spread": anchor.timing.spread,
            "peak_gb": m.peak_gb, "anchor_peak_gb": anchor.peak_gb,
            "losses": m.losses, "anchor_losses": anchor.losses, "max_loss_diff": loss_diff,
            "ideal": m.ideal.as_dict() if m.ideal else None,
            "anchor_ideal": anchor.ideal.as_dict() if anchor.ideal else None, **m.extra,
        }
        rec = ctx.record(Record(SUITE, f"{s.name} {self.schedule} {name}", "tokens/s",
                                m.tokens_per_s(self.tokens), anchor.tokens_per_s(self.tokens), anchor_name,
                                sizes=self._sizes, extra=extra))
        goal = GOALS.get(s.name)
        if goal is not None and name == "graph" and self.device.type == "cuda":
            ctx.note(f"GOAL {'MET' if rec.ratio >= goal else 'MISSED'} pipeline {s.name} {self.schedule}: "
                     f"graph {rec.ratio:.2f}x torch (goal >= {goal}x)")

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
    for bad, allowed, what in ((configs, CONFIGS, "configuration"), (schedules, SCHEDULES, "schedule"),
                               (variants, VARIANTS, "variant")):
        unknown = [v for v in bad if v not in allowed]
        if unknown:
            raise ValueError(f"pipeline: unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    variants = sorted(set(variants), key=VARIANTS.index)  # the anchor first: each variant is recorded against it
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
        for schedule in schedules:
            bench = PipelineBench(args, ctx, shape, schedule, dp)
            results: dict[str, Measured] = {}
            for variant in variants:
                ctx.step(f"{shape.name} {schedule} {variant}")
                free_device(ctx.device)
                try:
                    if variant == "torch":
                        got: Measured | str = bench.torch_anchor(groups)
                    else:
                        got = bench.peerline(graph=variant == "graph")
                except Exception as exc:  # noqa: BLE001 - the other variants still run; the suite fails at the end
                    log.exception("pipeline %s %s %s failed", shape.name, schedule, variant)
                    failures.append(f"{shape.name} {schedule} {variant}: {type(exc).__name__}: {exc}")
                    continue
                if isinstance(got, str):
                    ctx.note(f"pipeline {shape.name} {schedule} {variant}: skipped: {got}")
                    continue
                results[variant] = got
                bench.report_variant(variant, results)
                if ctx.is_writer:
                    log.info("pipeline %s %s %s: %.3f ms/iter (spread %.2f), %.0f tokens/s, losses %s",
                             shape.name, schedule, variant, got.timing.median_ms, got.timing.spread,
                             got.tokens_per_s(bench.tokens), ", ".join(f"{v:.6g}" for v in got.losses))
            bench.report_ideal(results)
            free_device(ctx.device)
    if failures:
        raise RuntimeError(f"{len(failures)} pipeline variant(s) failed: " + " | ".join(failures))
