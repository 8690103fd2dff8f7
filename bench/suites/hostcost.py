"""Benchmark suite `hostcost`: host time per launch and per engine action, eager, next to torch's.

    python launch/bench.py hostcost [--hostcost-rows 512] [--hostcost-hidden 512,2048]
    torchrun --nproc_per_node=2 launch/bench.py hostcost        (adds the transports' send / recv actions)

1. Ops (bench/kernel_tools/host_cost.py): microseconds of host time per call of bias+GELU and residual add
   (autograd forward, raw launch, backward) against torch's equivalent, bf16 and fp32, with the GPU kept busy by a
   spin kernel queued first (so only the host counts; medians). Also the ops through --kernels auto, and one raw
   launch through each launcher of kernels/launch.py (cuda-bindings, ctypes, CuPy) against torch's x + y.
2. Engine actions: a small residual-MLP model (4 blocks, h=512, 2x256 tokens, M=4, bf16, --no-graph) run as
   pp=1 with --stages 2 (one process), or pp=2 under two ranks with the copy engine and NCCL: the host time of
   each engine action (forward F, backward B, the transport exchange) per call, median over the timed iterations,
   with --kernels auto against --kernels torch.
Lower is better: ratio = torch / peerline, > 1 when peerline's host time is smaller.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record

log = logging.getLogger(__name__)

SUITE = "hostcost"
ACTIONS = ("_forward", "_backward", "_communicate")  # Engine methods timed as F, B, send/recv
ENGINE_SHAPE = dict(layers=4, hidden=512, micro_batch_size=2, seq=256, microbatches=4)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hostcost-rows", type=int, default=512, help="rows (tokens) of the op tensors")
    group.add_argument("--hostcost-hidden", type=_ints, default=(512, 2048), help="widths, comma-separated")
    group.add_argument("--hostcost-iters", type=int, default=6, help="timed eager iterations of the engine part")


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    if ctx.device.type != "cuda" and not ctx.quick:
        return "needs CUDA (or --quick for the CPU smoke test)"
    return None


def _record(ctx: BenchContext, case: str, pl: float, anchor: float, anchor_name: str, sizes: dict) -> None:
    ctx.record(Record(SUITE, case, "us/call (host)", pl, anchor, anchor_name, higher_is_better=False, sizes=sizes))


def _ops(args: argparse.Namespace, ctx: BenchContext) -> None:
    from peerline.bench.kernel_tools import host_cost

    rows = 8 if ctx.quick else args.hostcost_rows
    widths = (16,) if ctx.quick else args.hostcost_hidden
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in widths:
            sizes = {"rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch.")}
            pairs = {**host_cost.op_pairs(dtype, rows, hidden, ctx.device),
                     **host_cost.autograd_backward_pairs(dtype, rows, hidden, ctx.device)}
            pairs.update({f"{k} --kernels auto": v for k, v in
                          host_cost.op_pairs(dtype, rows, hidden, ctx.device, "auto").items() if "autograd" in k})
            for case, (pl, anchor) in pairs.items():
                ctx.step(f"{case} {sizes['dtype']} {rows}x{hidden}")
                _record(ctx, f"{case} {sizes['dtype']} {rows}x{hidden}", host_cost.host_us(pl, ctx.device),
                        host_cost.host_us(anchor, ctx.device), "torch eager", sizes)
    costs = host_cost.launcher_costs(ctx.device, rows, widths[0])
    torch_us = costs.pop("torch x + y")
    for name, us in costs.items():
        _record(ctx, f"residual_add raw launch {name}", us, torch_us, "torch x + y", {"rows": rows})


def _timed_engine(rt: Any) -> dict[str, list[float]]:
    """Wrap the engine's action methods on this instance: host seconds of every call, per action."""
    times: dict[str, list[float]] = {a: [] for a in ACTIONS}
    for name in ACTIONS:
        fn = getattr(rt.engine, name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Callable = fn, _out: list = times[name], **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _out.append((time.perf_counter() - t0) * 1e6)
        setattr(rt.engine, name, timed)
    return times


def _engine_actions(kernels: str, p2p: str, args: argparse.Namespace, ctx: BenchContext) -> dict[str, float]:
    """Median host microseconds per call of each engine action over the timed eager iterations."""
    from peerline.bench.runtime_timing import open_runtime
    from peerline.distributed.config import RunConfig

    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = dict(layers=2, hidden=16, micro_batch_size=2, seq=8, microbatches=4) if ctx.quick else ENGINE_SHAPE
    cfg = RunConfig(**shape, stages=2 if world == 1 else 1, schedule="1f1b", kernels=kernels, p2p=p2p,
                    dtype="bf16" if ctx.device.type == "cuda" else "fp32", device=ctx.device.type, graph=False,
                    iters=10**9, log_every=10**6)
    with open_runtime(cfg) as rt:
        rt.train(rt.iteration + 2)  # warm-up: kernels built, allocator filled
        times = _timed_engine(rt)
        t0 = time.perf_counter()
        rt.train(rt.iteration + (2 if ctx.quick else args.hostcost_iters))
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        per_iter = (time.perf_counter() - t0) * 1e6 / (2 if ctx.quick else args.hostcost_iters)
    out = {a.strip("_"): statistics.median(v) for a, v in times.items() if v}
    out["iteration (wall)"] = per_iter
    return out


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Op host costs, then the engine's per-action host costs (auto kernels vs torch kernels)."""
    if not hasattr(args, "hostcost_rows"):
        args.hostcost_rows, args.hostcost_hidden, args.hostcost_iters = 512, (512, 2048), 6
    if ctx.device.type == "cuda":
        _ops(args, ctx)
    world = dist.get_world_size() if dist.is_initialized() else 1
    transports = ("copy-engine", "nccl") if world == 2 and ctx.device.type == "cuda" else ("auto",)
    if world > 2:
        ctx.note("hostcost: the engine part runs on 1 or 2 ranks; skipped")
        return
    for p2p in transports:
        ctx.step(f"engine actions, p2p {p2p}")
        mine = _engine_actions("auto", p2p, args, ctx)
        ref = _engine_actions("torch", p2p, args, ctx)
        for action, us in mine.items():
            _record(ctx, f"engine {action} (pp={world}, stages={2 if world == 1 else 1}, p2p {p2p})", us,
                    ref.get(action, float("nan")), "same run with --kernels torch", dict(ENGINE_SHAPE))
