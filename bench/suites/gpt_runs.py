"""The measurements of the gpt suite for one GPT shape on this rank (pp = the world size): the anchor's candidates
(torch.distributed.pipelining running the plain torch GPT: schedule x precision recipe x blocks eager or compiled),
peerline's GPT under torch (schedule x recipe, eager: a second row), peerline eager and graph, and peerline under
each --recompute setting; and the one-GPU row (--gpt-single: `single_child` in a fresh process on rank 0's device,
started by the eager suite's run_fresh_child). Records are written by bench/suites/gpt_report.py; the suite's
docstring (gpt.py) says what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Timing
from peerline.bench.ideal import SPLIT, stages_per_rank
from peerline.bench.runtime_timing import (
    BlockTimer,
    Measured,
    anchor_losses_and_block,
    first_losses,
    free_device,
    measure_or_note,
    open_runtime,
    peak_gb_per_rank,
    runtime_block,
    time_anchor,
    time_captured,
)
from peerline.bench.suites.fresh_child import child_device, child_spec, child_timer, on_rank0, run_fresh_child
from peerline.bench.suites.gpt_anchor import (
    MODELS,
    GPTShape,
    PlainGPTOneDevice,
    StageCache,
    TorchGPTAnchor,
    token_source,
)
from peerline.bench.suites.gpt_report import GPTReport
from peerline.bench.suites.torch_schedules import AXES_WITH_BLOCKS, candidates, fastest, recipes_for, with_blocks
from peerline.choices import DEFAULT_ZB_ORDER
from peerline.distributed.memory.state_bytes import per_rank as state_bytes_per_rank
from peerline.distributed.memory.state_bytes import state_bytes

if TYPE_CHECKING:
    from peerline.distributed.config import RunConfig

log = logging.getLogger(__name__)

LOSS_CHECK_ITERS = 2  # iterations whose losses are read and compared before timing
#: the variants measured on torch (variant -> the anchor's model, gpt_anchor.MODELS); "torch" is the anchor
TORCH_VARIANTS = {"torch": "plain", "torch-peerline-gpt": "peerline"}
#: the schedules --gpt-zb-memory applies to
ZERO_BUBBLE = ("zb-h1", *SPLIT)
#: the one-GPU row (--gpt-single), after the configuration's name
ONE_GPU = "one-GPU eager bf16"


class GPTBench:
    """Every variant of one GPT shape on this rank; `results` by variant name (torch, torch-peerline-gpt, eager,
    graph). `blocks`: the plain anchor's blocks to try (eager, compiled)."""

    def __init__(self, args: argparse.Namespace, ctx: BenchContext, shape: GPTShape, blocks: list[str]) -> None:
        self.args, self.ctx, self.shape, self.device, self.blocks = args, ctx, shape, ctx.device, blocks
        self.pp, self.rank = dist.get_world_size(), dist.get_rank()
        self.timer = BlockTimer.from_args(args, ctx.quick, self.device, getattr(args, "gpt_iters", None))
        self.vocab, self.fill = token_source(shape)
        self.report = GPTReport(ctx, shape, self.vocab, self.pp)
        self.results: dict[str, Measured] = {}
        self._pairs: list[tuple[str, str]] | None = None
        # the anchor's fastest candidate (its StageCache, schedule, recipe, blocks), for --gpt-paired
        self._best: tuple[StageCache, str, str, str] | None = None
        # a peerline variant's name -> the anchor's timing taken in turn with it (--gpt-paired)
        self._paired: dict[str, Timing] = {}

    def run_variants(self, variants: list[str], failures: list[str]) -> dict[str, Measured]:
        """Measure each variant (the anchor first) and record it against the anchor as soon as both exist."""
        schedules = getattr(self.args, "gpt_schedules", None) or ["1f1b"]
        precisions = getattr(self.args, "gpt_precisions", None) or ["master"]
        kernel_impls = getattr(self.args, "gpt_kernels", None) or ["auto"]
        memories = getattr(self.args, "gpt_zb_memory", None) or ["fast"]
        orders = getattr(self.args, "gpt_zb_orders", None) or [DEFAULT_ZB_ORDER]
        runs = [(v, None, None, None, None, None) if v in TORCH_VARIANTS else (v, s, p, k, z, o)
                for v in variants for s in schedules for p in precisions for k in kernel_impls
                for z in (memories if s in ZERO_BUBBLE else ["fast"])
                for o in (orders if s in SPLIT else [DEFAULT_ZB_ORDER])]
        for variant, schedule, precision, kernels, memory, order in dict.fromkeys(runs):
            label = variant + variant_suffix(schedule, precision, kernels, memory, order)
            measure = (lambda v=variant: self.best_anchor(v, failures)) if variant in TORCH_VARIANTS else (
                lambda graph=variant == "graph", schedule=schedule, precision=precision, kernels=kernels,
                memory=memory, order=order: self.peerline(graph, schedule=schedule, precision=precision,
                                                          kernels=kernels, zb_memory=memory, zb_order=order,
                                                          paired=True))
            got = self._measure(label, measure, failures)
            if got is None:
                continue
            self.results[label] = got
            self.report.variant(got, self._anchor_for(got))
        if "torch" in variants and "torch" not in self.results:
            self.ctx.note(f"gpt {self.shape.name}: no anchor (the plain torch GPT under torch.distributed.pipelining "
                          "failed or did not run, see above): the other variants get no records against it")
        return self.results

    # -- the anchor ----------------------------------------------------------------------------------------------
    def candidates(self) -> list[tuple[str, str]]:
        """(schedule, recipe) pairs the torch runs try (torch_schedules.py), in order; one that does not apply is
        noted (once). The embedding and the head are layers of the split too."""
        if self._pairs is None:
            s = self.shape
            self._pairs = candidates(getattr(self.args, "gpt_anchor_schedules", None), recipes_for(s.dtype),
                                     self.pp, s.layers + 2, s.microbatches, 1, self.ctx.note, what=f"gpt {s.name}")
        return self._pairs

    def best_anchor(self, variant: str, failures: list[str]) -> Measured | str:
        """Every candidate of the variant's model measured (the plain GPT: each (schedule, recipe) with each of
        `blocks`; peerline's GPT: eager blocks); the fastest, named `variant`, its extra naming it and its model and
        listing every candidate."""
        model = TORCH_VARIANTS[variant]
        stages = StageCache(self.shape, self.vocab, model)
        blocks = self.blocks if model == "plain" else ["eager"]
        triples = with_blocks(self.candidates(), blocks, self.ctx.note, what=f"gpt {self.shape.name}")
        measured, best = fastest(self.ctx, f"{self.shape.name} {variant}", triples,
                                 lambda schedule, recipe, b: self.anchor(stages, schedule, recipe, b), failures,
                                 axes=AXES_WITH_BLOCKS)
        if best is None:
            return f"no torch candidate ran ({MODELS[model]})"
        best.name = variant
        if variant == "torch":
            self._best = (stages, best.extra["schedule"], best.extra["recipe"], best.extra["blocks"])
        self.report.candidates(measured, best)
        return best

    def _anchor_for(self, got: Measured) -> Measured | None:
        """The anchor a variant is recorded against: the search's fastest candidate, with the time it took in turn
        with this variant where --gpt-paired measured one (the search's own time kept in the variant's extra)."""
        anchor = self.results.get("torch")
        paired = self._paired.pop(got.name, None)
        if anchor is None or paired is None:
            return anchor
        got.extra["anchor_search_ms"] = anchor.timing.median_ms
        got.extra["anchor_paired"] = True
        return replace(anchor, timing=paired)

    def torch_anchor(self, stages: StageCache, schedule: str, recipe: str, blocks: str) -> TorchGPTAnchor:
        """The plain torch GPT under torch.distributed.pipelining: one anchor candidate, built."""
        return TorchGPTAnchor(stages, self.fill, schedule, recipe, self.pp, self.rank, self.device, blocks,
                              getattr(self.args, "gpt_compile_backend", None) or "inductor")

    def anchor(self, stages: StageCache, schedule: str, recipe: str, blocks: str) -> Measured:
        """One candidate: its first losses, then timed blocks of its iterations."""
        anchor = self.torch_anchor(stages, schedule, recipe, blocks)
        losses, timing = time_anchor(anchor, LOSS_CHECK_ITERS, self.timer)
        per_rank = peak_gb_per_rank(self.device)
        held = state_bytes_per_rank(state_bytes([p for m in anchor.modules for p in m.parameters()],
                                                anchor.optimizer))
        return Measured(f"torch {schedule} {recipe} {blocks}", timing, losses, None, max(per_rank, default=0.0),
                        {"model": MODELS[stages.model], "schedule": schedule, "recipe": recipe, "blocks": blocks,
                         "state_bytes": held}, per_rank)

    # -- peerline ------------------------------------------------------------------------------------------------
    def peerline(self, graph: bool, recompute: str = "off", schedule: str = "1f1b", precision: str = "master",
                 kernels: str = "auto", zb_memory: str = "fast", zb_order: str = DEFAULT_ZB_ORDER, paired: bool = False
                 ) -> Measured | str:
        """peerline with `schedule`, `precision` (--precision), `kernels` (--kernels), `zb_memory` (--zb-memory) and
        `zb_order` (--zb-order)
        on the same shape and data; why not, when the iteration was not captured. `paired` (with --gpt-paired and
        an anchor measured): the anchor's fastest candidate built again beside it, and their timed blocks taken in
        turn (BlockTimer.interleaved), so a GPU that warms up and clocks lower under its power cap, or a host that
        slows down, weighs on both; the anchor's time goes to `_paired`. Peak memory is then peerline's own: the
        peak of its first iterations less what the idle anchor holds."""
        cfg = peerline_config(self.shape, self.device, graph=graph, recompute=recompute, schedule=schedule,
                              stages=stages_per_rank(schedule, self.pp, self.shape.layers), precision=precision,
                              kernels=kernels, zb_memory=zb_memory, zb_order=zb_order)
        name = ("graph" if graph else "eager") + variant_suffix(schedule, precision, kernels, zb_memory, zb_order)
        pair, held = None, 0
        if paired and self._best is not None and getattr(self.args, "gpt_paired", True):
            pair = anchor_losses_and_block(self.torch_anchor(*self._best), LOSS_CHECK_ITERS)[1]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                held = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
        with open_runtime(cfg) as rt:
            if pair is None:
                measured = time_captured(rt, graph, LOSS_CHECK_ITERS, self.timer)
                if isinstance(measured, str):
                    return measured
                losses, timing = measured
                per_rank = peak_gb_per_rank(self.device)
            else:
                losses, not_captured = first_losses(rt, LOSS_CHECK_ITERS, graph)
                if not_captured:
                    return f"the iteration was not captured into a CUDA graph: {not_captured}"
                per_rank = peak_gb_per_rank(self.device, held)
                self._paired[name], timing = self.timer.interleaved([pair, runtime_block(rt)])
            extra: dict[str, Any] = {"model": "peerline's GPT", "transport": rt.transport_name,
                                     "recompute": recompute, "stage_layers": _most_stage_layers(rt, self.device),
                                     "state_bytes": rt.state_bytes_per_rank()}
        extra["schedule"] = schedule
        extra["precision"] = precision
        extra["kernels"] = kernels
        extra["zb_memory"] = zb_memory
        extra["zb_order"] = zb_order
        return Measured(name, timing, losses, None, max(per_rank, default=0.0), extra, per_rank)

    def recompute_table(self, failures: list[str]) -> None:
        """peerline --recompute N (half the largest stage's layers) and full against off (the graph run, else the
        eager one, already measured with the same settings)."""
        off = self.results.get("graph") or self.results.get("eager")
        if off is None:
            self.ctx.note(f"gpt {self.shape.name}: no peerline run to compare recomputation with; no table")
            return
        half = max(1, off.extra["stage_layers"] // 2)
        for setting in (str(half), "full"):
            got = self._measure(f"recompute {setting}",
                                lambda setting=setting: self.peerline(off.name == "graph", recompute=setting),
                                failures)
            if got is not None:
                self.report.recompute(got, off)

    def _measure(self, label: str, measure: Callable[[], Measured | str], failures: list[str]) -> Measured | None:
        """One measurement of this shape (runtime_timing.measure_or_note)."""
        return measure_or_note(self.ctx, "gpt", f"{self.shape.name} {label}", measure, failures)


def variant_suffix(schedule: str | None, precision: str | None, kernels: str | None, memory: str | None = None,
                   order: str | None = None) -> str:
    """What a peerline variant's name adds to eager / graph: each setting that is not the default."""
    return (("" if schedule in (None, "1f1b") else f" {schedule}") + ("" if precision in (None, "master") else
            f" {precision}") + ("" if kernels in (None, "auto") else f" kernels-{kernels}")
            + ("" if memory in (None, "fast") else f" zb-memory-{memory}")
            + ("" if order in (None, DEFAULT_ZB_ORDER) else f" zb-order-{order}"))


def peerline_config(shape: GPTShape, device: torch.device, **overrides: Any) -> RunConfig:
    """peerline's RunConfig of `shape` for a timed run: the data's vocab, no iteration limit, every loss read."""
    return shape.run_config(None, device=device.type, iters=10**9, log_every=1, **overrides)


# -- the one-GPU part (--gpt-single) ----------------------------------------------------------------------------
def one_gpu(args: argparse.Namespace, ctx: BenchContext, shape: GPTShape, failures: list[str]) -> None:
    """`shape`'s one-GPU row, a measurement of its own (measure_or_note: --isolate gives it a job): rank 0 runs
    `single_child` in a fresh process on its GPU while the other ranks wait, then records the row."""
    spec = {**child_spec(args, ctx.quick, getattr(args, "gpt_iters", None)), "shape": asdict(shape)}
    path = Path(ctx.out_dir) / f"gpt_single_{shape.name}.json"
    measure_or_note(ctx, "gpt", f"{shape.name} {ONE_GPU}", lambda: _one_gpu(ctx, spec, path), failures)


def _one_gpu(ctx: BenchContext, spec: dict[str, Any], path: Path) -> Measured | str | None:
    """peerline's side of the row on rank 0 (None elsewhere), the row recorded; why not when the child failed."""
    got = on_rank0(lambda: run_fresh_child(ctx, f"{__name__}:single_child", spec, path))
    if not isinstance(got, dict):
        return got
    mine, plain = (_from_child(got[side], name) for side, name in (("peerline", ONE_GPU), ("plain", MODELS["plain"])))
    GPTReport(ctx, GPTShape(**got["shape"]), got["vocab"], 1).one_gpu(mine, plain)
    return mine


def _from_child(side: dict[str, Any], name: str) -> Measured:
    peaks = list(side["peak_gb_per_rank"])
    return Measured(name, Timing(**side["timing"]), list(side["losses"]), None, max(peaks, default=0.0), {}, peaks)


def single_child(spec: dict[str, Any], out_path: str) -> None:
    """--gpt-single's process (one rank on its first visible device; fresh_child.run_fresh_child starts it): the whole
    plain torch GPT eager with bf16 parameters, then peerline --stages 1 --no-graph --precision bf16, on `spec`'s
    shape in bf16 with the same microbatches and seed; writes each side's timing, first losses and peak memory."""
    device = child_device()
    shape = replace(GPTShape(**spec["shape"]), dtype="bf16")
    timer = child_timer(spec, device)
    vocab, fill = token_source(shape)
    out: dict[str, Any] = {"shape": asdict(shape), "vocab": vocab}
    out["plain"] = _timed(device, lambda: time_anchor(PlainGPTOneDevice(shape, vocab, fill, device),
                                                      LOSS_CHECK_ITERS, timer))
    out["peerline"] = _timed(device, lambda: _peerline_one_gpu(shape, device, timer))
    Path(out_path).write_text(json.dumps(out))


def _timed(device: torch.device, measure: Callable[[], tuple[list[float], Timing]]) -> dict[str, Any]:
    """One side of the one-GPU row on a freed device: its timing, first losses and peak memory, as JSON data."""
    free_device(device)
    losses, timing = measure()
    return {"timing": asdict(timing), "losses": losses, "peak_gb_per_rank": peak_gb_per_rank(device)}


def _peerline_one_gpu(shape: GPTShape, device: torch.device, timer: BlockTimer) -> tuple[list[float], Timing]:
    cfg = peerline_config(shape, device, graph=False, stages=1, precision="bf16")
    with open_runtime(cfg) as rt:
        return time_captured(rt, False, LOSS_CHECK_ITERS, timer)  # eager: never a reason instead


def _most_stage_layers(rt, device: torch.device) -> int:
    """The largest number of layers one stage holds, over all ranks."""
    mine = max((len(stage.module) for stage in rt.engine.stages.values()), default=0)
    value = torch.tensor([mine], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
