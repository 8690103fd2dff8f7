"""Benchmark suite `eager`: peerline without CUDA graphs (--no-graph) against torch eager on the same model, data
and schedule: what a user gets when the iteration cannot be captured.

    torchrun --nproc_per_node=2 launch/bench.py eager [--eager-configs launch,mid,compute] [--eager-variants ...]
        [--eager-single | --no-eager-single]

Every torch variant runs the default model written in plain PyTorch (bench/suites/plain_mlp.py), from peerline's
initial weights.

Pipeline part, pp = world size, 1F1B, per configuration (the pipeline suite's CONFIGS: launch = 32 blocks h=512,
micro-batch 2x256, M=16; mid = 24 blocks h=1024, 4x512, M=12; compute, the pipeline suite's compute-bound one):
  torch             torch.distributed.pipelining Schedule1F1B, fp32 parameters + bf16 autocast
  torch-bf16        the same schedule with bf16 parameters and inputs, no autocast
  peerline          peerline --no-graph, defaults (--precision master, --kernels auto, the copy engine where it works)
  peerline-autocast --no-graph --precision autocast           (torch's recipe: fp32 parameters + bf16 autocast)
  peerline-bf16     --no-graph --precision bf16               (torch-bf16's recipe: bf16 parameters)
  peerline-torch-kernels   --no-graph --kernels torch         (diagnostic: what peerline's kernels are worth)
  peerline-nccl     --no-graph --p2p nccl                     (diagnostic: the transport)
Every peerline variant is recorded against both torch variants. The goals compare one recipe with the same recipe:
peerline-autocast >= 1.0x torch, peerline-bf16 >= 1.0x torch-bf16; each such pair is measured together, both
pipelines resident and their timed blocks alternating (A B, B A, ...), so a drift of the host during the suite falls
on both sides of a goal. The diagnostic variants run one after another.

One-GPU part (--eager-single, on by default): a fresh process on rank 0's GPU (the other ranks wait) trains the
whole model as one stage, per recipe: plain torch eager (per microbatch forward + loss + backward, then fused
AdamW; fp32 parameters under autocast, and bf16 parameters) against peerline --stages 1 --no-graph with the same
recipe (goal: >= 1.0x each). The model is built from the same seeds; the first losses of each are noted. Both sides
stay resident and their timed blocks alternate (A B, B A, ...: benchkit.time_blocks_interleaved), so a drift of the
host's speed during the child falls on both. The fresh process (run_fresh_child, on_rank0, child_spec,
child_device, child_timer) is shared with the gpt suite's --gpt-single; it times with the bench's --reps / --warmup.

Timing: benchkit.time_blocks (blocks of iterations without host syncs, the slowest rank, median over --reps).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.runtime_timing import (
    BlockTimer,
    anchor_losses_and_block,
    first_losses,
    free_device,
    measure_or_note,
    open_runtime,
    runtime_block,
    time_anchor,
    time_captured,
)
from peerline.bench.suites.fresh_child import child_device, child_spec, child_timer, on_rank0, run_fresh_child
from peerline.bench.suites.pipeline import CONFIGS
from peerline.bench.suites.torch_pipelining import PipeShape, TorchPipelineAnchor, build_stage_module, fill
from peerline.bench.suites.torch_schedules import host_lead

log = logging.getLogger(__name__)

SUITE = "eager"
#: variant -> RunConfig overrides of the peerline variants (all --no-graph)
PEERLINE_VARIANTS = {"peerline": {}, "peerline-autocast": {"precision": "autocast"},
                     "peerline-bf16": {"precision": "bf16"}, "peerline-torch-kernels": {"kernels": "torch"},
                     "peerline-nccl": {"p2p": "nccl"}}
TORCH_VARIANTS = ("torch", "torch-bf16")
VARIANTS = (*TORCH_VARIANTS, *PEERLINE_VARIANTS)
#: the recipe-matched pairs the goal is measured on: peerline variant -> torch variant of the same recipe
MATCHED = {"peerline-autocast": "torch", "peerline-bf16": "torch-bf16"}
GOAL = 1.0
#: the one-GPU part's recipes: name -> (plain torch's parameter dtype, peerline's --precision)
SINGLE_RECIPES = {"autocast": (None, "autocast"), "bf16": (torch.bfloat16, "bf16")}
RECIPE_LABELS = {"autocast": "fp32 parameters + autocast", "bf16": "bf16 parameters"}
LOSS_CHECK_ITERS = 2


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--eager-configs", type=_csv, default=None,
                       help="comma-separated configurations of the pipeline suite (default launch,mid,compute; "
                            "quick with --quick)")
    group.add_argument("--eager-variants", type=_csv, default=None,
                       help=f"comma-separated, of {', '.join(VARIANTS)} (default all)")
    group.add_argument("--eager-single", action=argparse.BooleanOptionalAction, default=True,
                       help="also the one-GPU part: plain torch eager vs peerline --stages 1 --no-graph")
    group.add_argument("--eager-iters", type=int, default=None, help="iterations per timed block (default 5)")


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    if ctx.device.type != "cuda" and not ctx.quick:
        return "needs CUDA (or --quick for the CPU smoke test)"
    return None


def _torch_variant(name: str, shape: PipeShape, ctx: BenchContext, timer: BlockTimer) -> tuple[list[float], Any]:
    pp, rank = dist.get_world_size(), dist.get_rank()
    param_dtype = torch.bfloat16 if name == "torch-bf16" and ctx.device.type == "cuda" else None
    anchor = TorchPipelineAnchor(shape, "1f1b", pp, 1, rank, ctx.device, param_dtype=param_dtype)
    return time_anchor(anchor, LOSS_CHECK_ITERS, timer)


def _peerline_variant(name: str, shape: PipeShape, ctx: BenchContext, timer: BlockTimer, **extra: Any
                      ) -> tuple[list[float], Any] | str:
    cfg = _peerline_config(name, shape, ctx, **extra)
    if isinstance(cfg, str):
        return cfg
    with open_runtime(cfg) as rt:
        got = time_captured(rt, False, LOSS_CHECK_ITERS, timer)
        if not isinstance(got, str):
            ctx.note(f"eager {shape.name} {name}: transport {rt.transport_name}")
        return got


def _peerline_config(name: str, shape: PipeShape, ctx: BenchContext, **extra: Any) -> Any:
    """The RunConfig of peerline variant `name` (--no-graph) on `shape`, or why it cannot run here."""
    from peerline.distributed.config import RunConfig

    overrides = {**PEERLINE_VARIANTS.get(name, {}), **extra}
    if overrides.get("precision") == "bf16" and ctx.device.type != "cuda":
        return "--precision bf16 needs bf16 compute (a GPU)"
    return RunConfig(schedule="1f1b", microbatches=shape.microbatches, micro_batch_size=shape.micro_batch_size,
                     seq=shape.seq, hidden=shape.hidden, layers=shape.layers, seed=shape.seed, lr=shape.lr,
                     dtype=shape.dtype, device=ctx.device.type, graph=False, iters=10**9, log_every=1,
                     **overrides)


def _report(ctx: BenchContext, shape: PipeShape, results: dict[str, tuple[list[float], Any]], name: str,
            world: int) -> None:
    """Record peerline variant `name` against every torch variant measured."""
    losses, timing = results[name]
    for anchor_name in TORCH_VARIANTS:
        if anchor_name not in results:
            continue
        a_losses, a_timing = results[anchor_name]
        rec = ctx.record(Record(SUITE, f"{shape.name} pp={world} 1f1b {name} vs {anchor_name}", "ms/iter",
                                timing.median_ms, a_timing.median_ms,
                                f"torch.distributed.pipelining 1f1b ({_recipe(anchor_name)})",
                                higher_is_better=False, sizes={**shape.sizes(), "pp": world},
                                extra={"losses": losses, "anchor_losses": a_losses, "spread": timing.spread,
                                       "anchor_spread": a_timing.spread, "host_lead_ms": timing.host_lead_ms,
                                       "anchor_host_lead_ms": a_timing.host_lead_ms}))
        if MATCHED.get(name) == anchor_name and ctx.device.type == "cuda":
            ctx.note(f"GOAL {'MET' if rec.ratio >= GOAL else 'MISSED'} eager {shape.name}: {name} --no-graph "
                     f"{rec.ratio:.2f}x torch {_recipe(anchor_name)} (goal >= {GOAL:.2f}x)")


def _recipe(anchor_name: str) -> str:
    return RECIPE_LABELS["bf16" if anchor_name == "torch-bf16" else "autocast"]


def _pipeline_part(args: argparse.Namespace, ctx: BenchContext, configs: list[str], variants: list[str]) -> list[str]:
    """Every configuration x variant on pp = world; returns the failures (the other variants still run). A peerline
    variant and the torch variant of its recipe (MATCHED), both asked for, are measured as one pair, their timed
    blocks alternating; the other variants one after another."""
    world = dist.get_world_size()
    timer = BlockTimer.from_args(args, ctx.quick, ctx.device, getattr(args, "eager_iters", None))
    failures = []
    for key in configs:
        shape = CONFIGS[key]
        results: dict[str, tuple[list[float], Any]] = {}
        pairs = [(p, t) for p, t in MATCHED.items()  # (a peerline variant this device cannot run goes alone: a note)
                 if p in variants and t in variants and not isinstance(_peerline_config(p, shape, ctx), str)]
        paired = {name for pair in pairs for name in pair}
        for peer, anchor in pairs:
            got = measure_or_note(ctx, "eager", f"{shape.name} {anchor} and {peer} interleaved",
                                  lambda p=peer, a=anchor, shape=shape: _paired(p, a, shape, ctx, timer), failures)
            if got is not None:
                results[anchor], results[peer] = got
                _note_variant(ctx, shape, world, anchor, got[0], "interleaved with " + peer)
                _note_variant(ctx, shape, world, peer, got[1], "interleaved with " + anchor)
        for name in (v for v in variants if v not in paired):
            got = measure_or_note(ctx, "eager", f"{shape.name} {name}", lambda name=name, shape=shape: (
                _torch_variant(name, shape, ctx, timer) if name in TORCH_VARIANTS
                else _peerline_variant(name, shape, ctx, timer)), failures)
            if got is not None:
                results[name] = got
                _note_variant(ctx, shape, world, name, got)
        for name in variants:
            if name in PEERLINE_VARIANTS and name in results:
                _report(ctx, shape, results, name, world)
    return failures


def _note_variant(ctx: BenchContext, shape: PipeShape, world: int, name: str, got: tuple[list[float], Any],
                  how: str = "") -> None:
    # The host lead says whether the variant was host-bound (near 0: its time follows the host).
    ctx.note(f"eager {shape.name} pp={world} {name}: {got[1].median_ms:.2f} ms/iter{host_lead(got[1])} "
             f"(spread {got[1].spread:.2f}{', ' + how if how else ''}), first losses "
             f"{', '.join(f'{v:.6g}' for v in got[0])}")


def _paired(peer: str, anchor: str, shape: PipeShape, ctx: BenchContext, timer: BlockTimer
            ) -> tuple[tuple[list[float], Any], tuple[list[float], Any]] | str:
    """torch variant `anchor` and peerline variant `peer` both resident: each one's first losses, then their timed
    blocks in turn (BlockTimer.interleaved), so a host that speeds up or slows down during the pair counts on both."""
    cfg = _peerline_config(peer, shape, ctx)
    if isinstance(cfg, str):
        return cfg
    pp, rank = dist.get_world_size(), dist.get_rank()
    param_dtype = torch.bfloat16 if anchor == "torch-bf16" and ctx.device.type == "cuda" else None
    torch_side = TorchPipelineAnchor(shape, "1f1b", pp, 1, rank, ctx.device, param_dtype=param_dtype)
    anchor_losses, anchor_block = anchor_losses_and_block(torch_side, LOSS_CHECK_ITERS)
    with open_runtime(cfg) as rt:
        peer_losses, _ = first_losses(rt, LOSS_CHECK_ITERS, False)
        anchor_t, peer_t = timer.interleaved([anchor_block, runtime_block(rt)])
        ctx.note(f"eager {shape.name} {peer}: transport {rt.transport_name}")
    return (anchor_losses, anchor_t), (peer_losses, peer_t)


class PlainTorch:
    """The whole model in plain torch eager on one device: per microbatch forward, loss / M and backward, then fused
    AdamW; fp32 parameters under the shape's autocast, or (param_dtype) parameters and inputs in that dtype with no
    autocast. The data of peerline's feed (same seeds)."""

    def __init__(self, shape: PipeShape, device: torch.device, param_dtype: torch.dtype | None = None) -> None:
        self.shape, self.device = shape, device
        self.module = build_stage_module(shape, 1, 0).to(device, dtype=param_dtype)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=shape.lr, fused=device.type == "cuda" or None)
        size = (shape.micro_batch_size, shape.seq, shape.hidden)
        self.inputs = [torch.empty(size, device=device, dtype=param_dtype) for _ in range(shape.microbatches)]
        self.targets = [torch.empty(size, device=device) for _ in range(shape.microbatches)]
        self.generator = torch.Generator(device=device)
        self.dtype = torch.bfloat16 if shape.dtype == "bf16" and param_dtype is None else None
        self.iteration, self.loss = 0, torch.zeros((), device=device)

    def step(self) -> None:
        for mb, (x, y) in enumerate(zip(self.inputs, self.targets)):
            fill(x, self.shape, self.iteration, mb, 0, self.generator)
            fill(y, self.shape, self.iteration, mb, 1, self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = torch.zeros((), device=self.device)
        for x, y in zip(self.inputs, self.targets):
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                out = self.module(x)
            loss = F.mse_loss(out.float(), y) / self.shape.microbatches
            loss.backward()
            self.loss += loss.detach()
        self.optimizer.step()
        self.iteration += 1

    def read_loss(self) -> float:
        return float(self.loss)


def single_child(spec: dict[str, Any], out_path: str) -> None:
    """The one-GPU part, in a process of its own (one rank, this process's first visible device): per recipe of
    SINGLE_RECIPES, plain torch eager and peerline --stages 1 --no-graph with the same recipe, both resident, their
    timed blocks taken in turn (BlockTimer.interleaved); writes their ms/iter and first losses to `out_path` (JSON:
    {"config", "recipes": {recipe: {...}}}). `spec`: child_spec's, with the configuration ("config")."""
    device = child_device()
    shape = CONFIGS[spec["config"]]
    ctx = BenchContext(out_dir=Path(out_path).parent, device=device, quick=spec["quick"])
    timer = child_timer(spec, device)
    recipes: dict[str, dict[str, Any]] = {}
    for recipe, (param_dtype, precision) in SINGLE_RECIPES.items():
        if param_dtype is not None and device.type != "cuda":
            continue  # bf16 parameters need bf16 compute: a GPU
        recipes[recipe] = _single_recipe(shape, ctx, timer, param_dtype, precision)
        free_device(device)
    Path(out_path).write_text(json.dumps({"config": spec["config"], "recipes": recipes}))


def _single_recipe(shape: PipeShape, ctx: BenchContext, timer: BlockTimer, param_dtype: torch.dtype | None,
                   precision: str) -> dict[str, Any]:
    """One recipe of the one-GPU part: each side's first losses, then their blocks interleaved."""
    plain_losses, plain_block = anchor_losses_and_block(PlainTorch(shape, ctx.device, param_dtype), LOSS_CHECK_ITERS)
    cfg = _peerline_config("peerline", shape, ctx, stages=1, precision=precision)
    if isinstance(cfg, str):
        return {"plain_ms": timer(plain_block).median_ms, "plain_losses": plain_losses, "peerline_skipped": cfg}
    with open_runtime(cfg) as rt:
        peerline_losses, _ = first_losses(rt, LOSS_CHECK_ITERS, False)
        plain_t, peerline_t = timer.interleaved([plain_block, runtime_block(rt)])
    return {"plain_ms": plain_t.median_ms, "plain_losses": plain_losses, "plain_spread": plain_t.spread,
            "peerline_ms": peerline_t.median_ms, "peerline_losses": peerline_losses,
            "peerline_spread": peerline_t.spread, "timing": "interleaved"}


def _single_part(args: argparse.Namespace, ctx: BenchContext, configs: list[str]) -> None:
    """Rank 0 runs `single_child` per configuration in a fresh process on its GPU; every rank waits for it."""
    for key in configs:
        ctx.step(f"eager {CONFIGS[key].name}: one GPU, plain torch vs peerline (fresh process)")
        spec = {**child_spec(args, ctx.quick, getattr(args, "eager_iters", None)), "config": key}
        path = Path(ctx.out_dir) / f"eager_single_{key}.json"
        got = on_rank0(lambda spec=spec, path=path: run_fresh_child(ctx, f"{__name__}:single_child", spec, path))
        if isinstance(got, str):
            ctx.note(f"eager one-GPU {key} failed: {got}")
        elif got is not None:
            _record_single(ctx, key, got)


def _record_single(ctx: BenchContext, key: str, result: dict[str, Any]) -> None:
    """One record per recipe the child measured: peerline against plain torch, ms/iter."""
    shape = CONFIGS[key]
    for recipe, r in result["recipes"].items():
        if "peerline_ms" not in r:
            ctx.note(f"eager one-GPU {key} {recipe}: peerline skipped: {r.get('peerline_skipped')}")
            continue
        label = RECIPE_LABELS[recipe]
        rec = ctx.record(Record(SUITE, f"{shape.name} 1 GPU peerline --stages 1 --no-graph --precision {recipe} vs "
                                f"plain torch", "ms/iter", r["peerline_ms"], r["plain_ms"],
                                f"plain torch eager, {label}", higher_is_better=False, sizes=shape.sizes(),
                                extra={"recipe": recipe, **r}))
        ctx.note(f"eager one-GPU {shape.name} {recipe}: peerline {r['peerline_ms']:.2f} ms/iter (losses "
                 f"{', '.join(f'{v:.6g}' for v in r['peerline_losses'])}), plain torch {r['plain_ms']:.2f} ms/iter "
                 f"(losses {', '.join(f'{v:.6g}' for v in r['plain_losses'])})")
        if ctx.device.type == "cuda":
            ctx.note(f"GOAL {'MET' if rec.ratio >= GOAL else 'MISSED'} eager one-GPU {shape.name} {recipe}: "
                     f"peerline {rec.ratio:.2f}x plain torch (goal >= {GOAL:.2f}x)")


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """The pipeline part on pp = world, then the one-GPU part; see the module docstring."""
    configs = getattr(args, "eager_configs", None) or (["quick"] if ctx.quick else ["launch", "mid", "compute"])
    variants = getattr(args, "eager_variants", None) or list(VARIANTS)
    for bad, allowed, what in ((configs, CONFIGS, "configuration"), (variants, VARIANTS, "variant")):
        unknown = [v for v in bad if v not in allowed]
        if unknown:
            raise ValueError(f"eager: unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    variants = sorted(set(variants), key=VARIANTS.index)  # the torch anchors first
    failures = _pipeline_part(args, ctx, configs, variants) if dist.get_world_size() > 1 else []
    if dist.get_world_size() == 1:
        ctx.note("eager: one rank: the pipeline part needs torchrun --nproc_per_node=2; the one-GPU part only")
    if getattr(args, "eager_single", True):
        free_device(ctx.device)  # the child shares rank 0's GPU
        _single_part(args, ctx, configs)
    if failures:
        raise RuntimeError(f"{len(failures)} eager variant(s) failed: " + " | ".join(failures))
