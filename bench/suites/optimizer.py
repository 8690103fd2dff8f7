"""Benchmark suite `optimizer`: `--shard-optimizer` (ZeRO-1 over the dp group) against the bucketed all-reduce step
it replaces, and against DDP + torch.distributed.optim.ZeroRedundancyOptimizer on the same model.

    torchrun --nproc_per_node=2 launch/bench.py optimizer                        (pp=1 x dp=2)
    torchrun --nproc_per_node=4 launch/bench.py optimizer --optimizer-dp 2       (pp=2 x dp=2)
    torchrun --nproc_per_node=2 launch/bench.py optimizer --quick                (the CPU smoke test)

Configurations (1F1B, AdamW, MSE on synthetic targets; graphs on a GPU):
  compute  8 residual-MLP blocks of h=2048 (268 M parameters), bf16 autocast, micro-batch 4x512, M=8 per replica
  quick    2 blocks of h=32, fp32, micro-batch 2x8, M=2                          (--quick)

Variants: `zero` (the anchor: torch.distributed.pipelining's 1F1B with DDP over the replicas, its AdamW wrapped in
ZeroRedundancyOptimizer), `allreduce` (peerline, unsharded AdamW), `sharded` (peerline --shard-optimizer) and
`overlap` (--shard-optimizer --overlap-param-gather: the all-gathers beside the next forward). Each: step time
(benchkit blocks, median), optimizer state bytes on every rank, peak device memory, the first losses (all start from
the same weights and data). Records: sharded and overlap vs allreduce and vs the anchor (ms/iter), and the optimizer
state per rank (bytes, sharded vs allreduce: about dp). Goals on GPUs: within 3% of the all-reduce step, faster than
the anchor, state about 1/dp.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.runtime_timing import (
    BlockTimer,
    free_device,
    measure_or_note,
    open_runtime,
    peak_gb,
    time_anchor,
    time_captured,
)
from peerline.bench.suites.torch_pipelining import PipeShape, TorchPipelineAnchor

log = logging.getLogger(__name__)

SUITE = "optimizer"
CONFIGS = {
    "compute": PipeShape("compute", layers=8, hidden=2048, micro_batch_size=4, seq=512, microbatches=8,
                         dtype="bf16"),
    "quick": PipeShape("quick", layers=2, hidden=32, micro_batch_size=2, seq=8, microbatches=2, dtype="fp32"),
}
VARIANTS = ("zero", "allreduce", "sharded", "overlap")
#: the sharded variants: their flags
SHARDED = {"sharded": {"shard_optimizer": True}, "overlap": {"shard_optimizer": True, "overlap_param_gather": True}}
LOSS_CHECK_ITERS = 2
#: goals on GPUs: sharded step time / all-reduce step time at most this; state per rank at most (1/dp) x this
STEP_GOAL, MEMORY_SLACK = 1.03, 1.1


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--optimizer-configs", default=None,
                       help="comma-separated: compute, quick (default compute; quick with --quick)")
    group.add_argument("--optimizer-dp", type=int, default=2,
                       help="data-parallel replicas of the optimizer suite (pp = world size / dp; default 2)")
    group.add_argument("--optimizer-iters", type=int, default=None, help="iterations per timed block (default 5)")


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    world, dp = dist.get_world_size(), getattr(args, "optimizer_dp", 2) or 2
    if dp < 2 or world % dp:
        return f"needs dp >= 2 dividing the world size (--optimizer-dp {dp}, {world} ranks)"
    return None


def _bytes_per_rank(mine: int) -> list[int]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, int(mine))
    return [int(v) for v in everyone]


def _dp_group(pp: int, dp: int, rank: int) -> Any:
    """This rank's dp group for the anchor (every rank creates every group, in the same order)."""
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
    """The variants of one configuration on this rank; each returns a dict of its figures."""

    def __init__(self, args: argparse.Namespace, ctx: BenchContext, shape: PipeShape, dp: int,
                 groups: tuple[Any, Any]) -> None:
        self.ctx, self.shape, self.dp, self.groups = ctx, shape, dp, groups
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.pp = self.world // dp
        self.timer = BlockTimer.from_args(args, ctx.quick, ctx.device, getattr(args, "optimizer_iters", None))

    def zero_anchor(self) -> dict[str, Any]:
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
                "state_bytes": _bytes_per_rank(optimizer_state_bytes(anchor.optimizer.optim))}

    def peerline(self, variant: str) -> dict[str, Any] | str:
        """A peerline variant: allreduce, or a sharded one (SHARDED's flags)."""
        from peerline.distributed.config import RunConfig

        s, graph = self.shape, self.ctx.device.type == "cuda"
        cfg = RunConfig(dp=self.dp, schedule="1f1b", microbatches=s.microbatches, micro_batch_size=s.micro_batch_size,
                        seq=s.seq, hidden=s.hidden, layers=s.layers, seed=s.seed, lr=s.lr, dtype=s.dtype,
                        device=self.ctx.device.type, graph=graph, iters=10**9, log_every=1,
                        precision="autocast",  # fp32 weights (bf16 autocast on bf16 shapes): what the sharding shards
                        **SHARDED.get(variant, {}))
        with open_runtime(cfg) as rt:
            measured = time_captured(rt, graph, LOSS_CHECK_ITERS, self.timer)
            if isinstance(measured, str):
                return measured
            losses, timing = measured
            return {"ms": timing.median_ms, "spread": timing.spread, "losses": losses,
                    "peak_gb": peak_gb(self.ctx.device), "state_bytes": rt.optimizer_state_bytes_per_rank()}

    def _step_records(self, variant: str, results: dict[str, dict[str, Any]], grid: str, sizes: dict[str, Any],
                      extra: dict[str, Any]) -> None:
        """A sharded variant's step time against the unsharded step and the anchor, with its GOAL lines."""
        mine = results[variant]
        for name, what in (("allreduce", "peerline bucketed all-reduce, unsharded AdamW"),
                           ("zero", "DDP + ZeroRedundancyOptimizer (torch 1F1B)")):
            anchor = results.get(name)
            if anchor is None:
                continue
            diff = max((abs(a - b) for a, b in zip(mine["losses"], anchor["losses"], strict=False)), default=math.nan)
            rec = self.ctx.record(Record(SUITE, f"{grid} {variant} vs {name}", "ms/iter", mine["ms"], anchor["ms"],
                                         what, higher_is_better=False, sizes=sizes,
                                         extra={**extra, "max_loss_diff": diff}))
            goal = STEP_GOAL if name == "allreduce" else 1.0
            if self.ctx.device.type == "cuda":
                met = rec.ratio >= 1 / goal
                self.ctx.note(f"GOAL {'MET' if met else 'MISSED'} optimizer {grid}: {variant} step {rec.ratio:.3f}x "
                              f"{name} (goal >= {1 / goal:.3f}x)")

    def report(self, results: dict[str, dict[str, Any]]) -> None:
        """The records of the configuration, from what was measured."""
        sharded, base = results.get("sharded"), results.get("allreduce")
        sizes = {**self.shape.sizes(), "pp": self.pp, "dp": self.dp}
        extra = {f"{name}_{key}": value for name, r in results.items() for key, value in r.items()}
        grid = f"{self.shape.name} pp={self.pp} dp={self.dp}"
        for variant in SHARDED:
            if variant in results:
                self._step_records(variant, results, grid, sizes, extra)
        if sharded is not None and base is not None:
            rec = self.ctx.record(Record(SUITE, f"{grid} optimizer state per rank", "bytes",
                                         max(sharded["state_bytes"]), max(base["state_bytes"]),
                                         "unsharded AdamW (peerline)", higher_is_better=False, sizes=sizes,
                                         extra=extra))
            met = rec.ratio >= self.dp / MEMORY_SLACK
            self.ctx.note(f"GOAL {'MET' if met else 'MISSED'} optimizer {grid}: state per rank 1/{rec.ratio:.2f} "
                          f"of unsharded (goal about 1/{self.dp})")


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Every configuration x variant; see the module docstring."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = getattr(args, "optimizer_dp", 2) or 2
    if dp < 2 or world % dp:
        raise ValueError(f"optimizer: --optimizer-dp {dp} must be >= 2 and divide the world size {world}")
    names = [c.strip() for c in (getattr(args, "optimizer_configs", None) or "").split(",") if c.strip()]
    names = names or (["quick"] if ctx.quick else ["compute"])
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"optimizer: unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    pp = world // dp
    groups = (_pp_group(pp, dp, rank), _dp_group(pp, dp, rank))  # a pipeline of one rank has a group of its own
    failures: list[str] = []
    for name in names:
        bench = OptimizerBench(args, ctx, CONFIGS[name], dp, groups)
        results: dict[str, dict[str, Any]] = {}
        for variant in VARIANTS:
            got = measure_or_note(ctx, "optimizer", f"{name} {variant}", lambda variant=variant, bench=bench: (
                bench.zero_anchor() if variant == "zero" else bench.peerline(variant)), failures)
            if got is None:
                continue
            results[variant] = got
            if ctx.is_writer:
                log.info("optimizer %s %s: %.3f ms/iter, state %s bytes/rank, losses %s", name, variant, got["ms"],
                         got["state_bytes"], ", ".join(f"{v:.6g}" for v in got["losses"]))
        bench.report(results)
        free_device(ctx.device)
    if failures:
        raise RuntimeError(f"{len(failures)} optimizer variant(s) failed: " + " | ".join(failures))
