"""Benchmark suite `optimizer`: `--shard-optimizer` (ZeRO-1 over the dp group) against the bucketed all-reduce step
it replaces, beside plain torch data parallelism on the same shape: DDP, and DDP + ZeroRedundancyOptimizer.

    torchrun --nproc_per_node=2 launch/bench.py optimizer                        (the GPT, pp=1 x dp=2)
    torchrun --nproc_per_node=2 launch/bench.py optimizer --optimizer-model gpt,mlp
    torchrun --nproc_per_node=4 launch/bench.py optimizer --optimizer-dp 2       (pp=2 x dp=2)
    torchrun --nproc_per_node=2 launch/bench.py optimizer --quick                (the CPU smoke test)

Models (--optimizer-model, default gpt) x configurations (--optimizer-configs, default compute; quick with --quick);
1F1B, AdamW, fp32 parameters under bf16 autocast on bf16 shapes (--precision autocast: what the sharding shards);
graphs on a GPU:
  gpt  the gpt suite's shapes (bench/suites/gpt.py CONFIGS; its --gpt-layers ... flags resize compute): compute
       24 blocks, hidden 2048, 16 heads, seq 2048, micro-batch 1, M=8 per replica, bf16; quick 2 blocks of 32, fp32.
       peerline --model gpt on the default corpus, cross-entropy
  mlp  compute 8 residual-MLP blocks of h=2048 (268 M parameters), bf16, micro-batch 4x512, M=8 per replica;
       quick 2 blocks of h=32, fp32, micro-batch 2x8, M=2. MSE on synthetic targets

Rows (--optimizer-variants, default all that apply):
  ddp        torch DDP + AdamW (fused) over the plain torch model, eager (bench/suites/ddp_anchor.py: plain_gpt.py's
             GPT, or plain_mlp.py's blocks with peerline's weights), pp=1 x dp = the world size, same global batch
  ddp-zero   the same with torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  zero       the MLP at pp > 1: torch.distributed.pipelining's 1F1B with DDP over the replicas and
             ZeroRedundancyOptimizer (at pp=1 the ddp-zero row is this)
  allreduce  peerline, unsharded AdamW;  sharded  --shard-optimizer;  overlap  --shard-optimizer
             --overlap-param-gather (the all-gathers beside the next forward)
Each row: ms/iter (benchkit blocks of --optimizer-iters iterations, median over --reps blocks after --warmup; by
default 3 after 1, 2 after 1 with --quick), tokens/s, optimizer state bytes on every rank, peak device memory, the
first losses (the MLP rows and peerline's start from the same weights and data; the plain GPT has its own init).
The table is one note per row; records: sharded and overlap vs allreduce and vs each torch row (ms/iter; extra:
every row's figures), and the optimizer state per rank (sharded vs allreduce: about dp). GOAL lines on GPUs:
sharded and overlap within 3% of the all-reduce step; state per rank at most 1.1/dp of unsharded (on any device).
A RATIO line says which torch row is faster than each sharded step.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext
from peerline.bench.runtime_timing import (
    BlockTimer,
    free_device,
    measure_or_note,
    open_runtime,
    peak_gb,
    time_anchor,
    time_captured,
)
from peerline.bench.suites import gpt as gpt_suite
from peerline.bench.suites.ddp_anchor import DDPAnchor, GPTWorkload, MLPWorkload
from peerline.bench.suites.gpt_anchor import GPTShape, StageCache, token_source
from peerline.bench.suites.optimizer_report import SUITE, OptimizerReport
from peerline.bench.suites.torch_pipelining import PipeShape, TorchPipelineAnchor

MODELS = ("gpt", "mlp")
#: the MLP's configurations; the GPT's are the gpt suite's (gpt_suite.CONFIGS), by the same names
CONFIGS = {
    "compute": PipeShape("compute", layers=8, hidden=2048, micro_batch_size=4, seq=512, microbatches=8,
                         dtype="bf16"),
    "quick": PipeShape("quick", layers=2, hidden=32, micro_batch_size=2, seq=8, microbatches=2, dtype="fp32"),
}
VARIANTS = ("ddp", "ddp-zero", "zero", "allreduce", "sharded", "overlap")
#: the rows run on torch
TORCH_ROWS = ("ddp", "ddp-zero", "zero")
#: the sharded rows: their flags
SHARDED = {"sharded": {"shard_optimizer": True}, "overlap": {"shard_optimizer": True, "overlap_param_gather": True}}
LOSS_CHECK_ITERS = 2
#: timed blocks and warm-up blocks by default off --quick (--reps, --warmup win): the GPT at dp=2 stays short
REPS, WARMUP = 3, 1


def _csv(text: str | None) -> list[str]:
    return [v.strip() for v in (text or "").split(",") if v.strip()]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--optimizer-model", default=None,
                       help="comma-separated: gpt (peerline --model gpt at the gpt suite's shapes; the --gpt-layers "
                            "... flags resize its compute one), mlp (the default residual MLP) (default gpt)")
    group.add_argument("--optimizer-configs", default=None,
                       help="comma-separated: compute, quick (default compute; quick with --quick)")
    group.add_argument("--optimizer-variants", default=None,
                       help="comma-separated rows: ddp (torch DDP + AdamW), ddp-zero (DDP + ZeroRedundancyOptimizer), "
                            "zero (the MLP at pp > 1: torch pipelining + DDP + ZeroRedundancyOptimizer), allreduce, "
                            "sharded (--shard-optimizer), overlap (with --overlap-param-gather) (default all)")
    group.add_argument("--optimizer-dp", type=int, default=2,
                       help="data-parallel replicas of the peerline rows (pp = world size / dp; default 2); the ddp "
                            "rows run pp=1 x dp = world size on the same global batch")
    group.add_argument("--optimizer-iters", type=int, default=None,
                       help=f"iterations per timed block (default 5; {REPS} timed blocks after {WARMUP} warm-up "
                            "unless --reps / --warmup)")


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    world, dp = dist.get_world_size(), getattr(args, "optimizer_dp", 2) or 2
    if dp < 2 or world % dp:
        return f"needs dp >= 2 dividing the world size (--optimizer-dp {dp}, {world} ranks)"
    return None


def _choose(text: str | None, default: list[str], allowed: tuple[str, ...] | dict, what: str) -> list[str]:
    chosen = _csv(text) or default
    unknown = [v for v in chosen if v not in allowed]
    if unknown:
        raise ValueError(f"optimizer: unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(chosen))


def shape_of(args: argparse.Namespace, model: str, config: str) -> PipeShape | GPTShape:
    """The shape of one model and configuration; the GPT's compute one resized by the gpt suite's size flags."""
    return CONFIGS[config] if model == "mlp" else gpt_suite.shape_named(args, config)


def _timer(args: argparse.Namespace, ctx: BenchContext) -> BlockTimer:
    timer = BlockTimer.from_args(args, ctx.quick, ctx.device, getattr(args, "optimizer_iters", None))
    if ctx.quick:
        return timer
    warmup = getattr(args, "warmup", None)
    return replace(timer, reps=getattr(args, "reps", None) or REPS, warmup=WARMUP if warmup is None else warmup)


def _bytes_per_rank(mine: int) -> list[int]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, int(mine))
    return [int(v) for v in everyone]


def _dp_group(pp: int, dp: int, rank: int) -> Any:
    """This rank's dp group for the pipelining anchor (every rank creates every group, in the same order)."""
    mine = None
    for stage in range(pp):
        group = dist.new_group([r * pp + stage for r in range(dp)])
        if stage == rank % pp:
            mine = group
    return mine


def _pp_group(pp: int, dp: int, rank: int) -> Any:
    mine = None
    for replica in range(dp):
        group = dist.new_group([replica * pp + s for s in range(pp)])
        if replica == rank // pp:
            mine = group
    return mine


class OptimizerBench:
    """The rows of one model and configuration on this rank; each returns a dict of its figures."""

    def __init__(self, args: argparse.Namespace, ctx: BenchContext, model: str, config: str, dp: int,
                 groups: tuple[Any, Any]) -> None:
        self.ctx, self.model, self.dp, self.groups = ctx, model, dp, groups
        self.shape = shape_of(args, model, config)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.pp = self.world // dp
        self.grid = f"{model}-{config} pp={self.pp} dp={dp}"
        self.timer = _timer(args, ctx)
        s = self.shape
        self.tokens = s.microbatches * s.micro_batch_size * s.seq * dp  # per iteration, every row alike
        self._gpt: tuple[int, Any, StageCache] | None = None

    def why_not(self) -> dict[str, str]:
        """The rows that do not apply here, with why."""
        why = {}
        if self.model != "mlp" or self.pp == 1:
            why["zero"] = "the pipelining anchor runs the MLP at pp > 1 (at pp=1 the ddp-zero row is it)"
        if self.shape.microbatches * self.dp % self.world:
            for v in ("ddp", "ddp-zero"):
                why[v] = f"M={self.shape.microbatches} x dp={self.dp} microbatches do not split over {self.world} ranks"
        return why

    def measure(self, variant: str) -> dict[str, Any] | str:
        got = self.peerline(variant) if variant not in TORCH_ROWS else (
            self.zero_anchor() if variant == "zero" else self.ddp_anchor(variant))
        if not isinstance(got, str):
            got["tokens_per_s"] = self.tokens / (got["ms"] / 1e3)
        return got

    def _gpt_data(self) -> tuple[int, Any, StageCache]:
        """(vocabulary, the text feed's fill, the plain GPT's CPU model), made once."""
        if self._gpt is None:
            vocab, fill = token_source(self.shape)
            self._gpt = vocab, fill, StageCache(self.shape, vocab, "plain")
        return self._gpt

    def ddp_anchor(self, variant: str) -> dict[str, Any]:
        """ddp or ddp-zero: the plain model at pp=1 x dp = the world size (ddp_anchor.py)."""
        s, replica, device = self.shape, self.rank, self.ctx.device
        microbatches = s.microbatches * self.dp // self.world
        if self.model == "gpt":
            _, fill, stages = self._gpt_data()
            workload: Any = GPTWorkload(stages, fill, microbatches, replica, device)
        else:
            workload = MLPWorkload(s, microbatches, replica, device)
        anchor = DDPAnchor(workload, s.micro_batch_size, s.lr, device, autocast=s.dtype == "bf16",
                           zero=variant == "ddp-zero")
        losses, timing = time_anchor(anchor, LOSS_CHECK_ITERS, self.timer)
        return {"ms": timing.median_ms, "spread": timing.spread, "losses": losses, "peak_gb": peak_gb(device),
                "state_bytes": _bytes_per_rank(anchor.optimizer_state_bytes()), "grid": f"pp=1 dp={self.world}"}

    def zero_anchor(self) -> dict[str, Any]:
        """The MLP under torch.distributed.pipelining 1F1B at this pp x dp, DDP + ZeroRedundancyOptimizer."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from peerline.distributed.grad_sync.sharded_adamw import optimizer_state_bytes

        anchor = TorchPipelineAnchor(self.shape, "1f1b", self.pp, self.dp, self.rank, self.ctx.device,
                                     pp_group=self.groups[0], dp_group=self.groups[1])
        on_gpu = self.ctx.device.type == "cuda"
        anchor.optimizer = ZeroRedundancyOptimizer(anchor.module.parameters(), optimizer_class=torch.optim.AdamW,
                                                   process_group=self.groups[1], lr=self.shape.lr,
                                                   fused=on_gpu or None)
        losses, timing = time_anchor(anchor, LOSS_CHECK_ITERS, self.timer)
        return {"ms": timing.median_ms, "spread": timing.spread, "losses": losses, "peak_gb": peak_gb(self.ctx.device),
                "state_bytes": _bytes_per_rank(optimizer_state_bytes(anchor.optimizer.optim)),
                "grid": f"pp={self.pp} dp={self.dp}"}

    def run_config(self, variant: str):
        """peerline's RunConfig of a row: allreduce, or a sharded one (SHARDED's flags)."""
        from peerline.distributed.config import RunConfig

        s, graph = self.shape, self.ctx.device.type == "cuda"
        common = {"dp": self.dp, "schedule": "1f1b", "device": self.ctx.device.type, "graph": graph,
                  "iters": 10**9, "log_every": 1,
                  "precision": "autocast",  # fp32 weights (bf16 autocast on bf16 shapes): what the sharding shards
                  **SHARDED.get(variant, {})}
        if self.model == "gpt":
            return s.run_config(None, **common)
        return RunConfig(microbatches=s.microbatches, micro_batch_size=s.micro_batch_size, seq=s.seq,
                         hidden=s.hidden, layers=s.layers, seed=s.seed, lr=s.lr, dtype=s.dtype, **common)

    def peerline(self, variant: str) -> dict[str, Any] | str:
        """A peerline row: allreduce, sharded or overlap."""
        cfg = self.run_config(variant)
        with open_runtime(cfg) as rt:
            measured = time_captured(rt, cfg.graph, LOSS_CHECK_ITERS, self.timer)
            if isinstance(measured, str):
                return measured
            losses, timing = measured
            return {"ms": timing.median_ms, "spread": timing.spread, "losses": losses,
                    "peak_gb": peak_gb(self.ctx.device), "state_bytes": rt.optimizer_state_bytes_per_rank(),
                    "grid": f"pp={self.pp} dp={self.dp}"}


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Every model x configuration x row; see the module docstring."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = getattr(args, "optimizer_dp", 2) or 2
    if dp < 2 or world % dp:
        raise ValueError(f"optimizer: --optimizer-dp {dp} must be >= 2 and divide the world size {world}")
    models = _choose(getattr(args, "optimizer_model", None), ["gpt"], MODELS, "model")
    configs = _choose(getattr(args, "optimizer_configs", None), ["quick"] if ctx.quick else ["compute"], CONFIGS,
                      "configuration")
    asked = _csv(getattr(args, "optimizer_variants", None))
    wanted = _choose(getattr(args, "optimizer_variants", None), list(VARIANTS), VARIANTS, "variant")
    pp = world // dp
    groups = (_pp_group(pp, dp, rank), _dp_group(pp, dp, rank))  # a pipeline of one rank has a group of its own
    failures: list[str] = []
    for model in models:
        for config in configs:
            bench = OptimizerBench(args, ctx, model, config, dp, groups)
            why_not = bench.why_not()
            for variant in (v for v in asked if v in why_not):
                ctx.note(f"optimizer {bench.grid}: no {variant} row: {why_not[variant]}")
            results: dict[str, dict[str, Any]] = {}
            for variant in (v for v in wanted if v not in why_not):
                got = measure_or_note(ctx, SUITE, f"{bench.grid.split()[0]} {variant}",
                                      lambda variant=variant, bench=bench: bench.measure(variant), failures)
                if got is not None:
                    results[variant] = got
            OptimizerReport(ctx, bench).write(results)
            free_device(ctx.device)
    if failures:
        raise RuntimeError(f"{len(failures)} optimizer variant(s) failed: " + " | ".join(failures))


__all__ = ["CONFIGS", "MODELS", "VARIANTS", "OptimizerBench", "add_arguments", "run", "shape_of"]
