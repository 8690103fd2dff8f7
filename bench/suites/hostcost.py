"""Benchmark suite `hostcost`: host time per launch and per engine action, eager, next to torch's.

    python launch/bench.py hostcost [--hostcost-rows 512] [--hostcost-hidden 512,2048]
    torchrun --nproc_per_node=2 launch/bench.py hostcost        (adds the transports' send / recv actions)
    torchrun --nproc_per_node=2 launch/bench.py hostcost --hostcost-shapes small,launch

1. Ops (bench/kernel_tools/host_cost.py): microseconds of host time per call of bias+GELU and residual add
   (autograd forward, raw launch, backward) against torch's equivalent, bf16 and fp32, with the GPU kept busy by a
   spin kernel queued first (so only the host counts; medians). Also the ops through --kernels auto, and one raw
   launch through each launcher of kernels/launch.py (cuda-bindings, ctypes, CuPy) against torch's x + y.
2. Engine actions (--hostcost-shapes: small = 4 blocks, h=512, 2x256 tokens, M=4; launch = the launch-bound
   pipeline shape, 32 blocks, M=16; bf16, --no-graph), run as pp=1 with --stages 2 (one process), or pp=2 under
   two ranks with the copy engine and NCCL: the host time per call of each engine action (F, B, W, the send/recv
   step) and transport call (exchange, release), median over the timed iterations; the engine's own host time
   per iteration (the iteration less its actions); Python calls per iteration (a cProfile count, independent of
   the machine's load); all with --kernels auto against --kernels torch. F and B also against the rank's first
   stage module called directly in plain torch eager (the floor the engine adds to). Run it on the commit before
   a change and after it for the before/after of the engine's host cost.
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
from peerline.kernels.capture_state import eager_only

log = logging.getLogger(__name__)

SUITE = "hostcost"
#: Engine methods timed per call: forward, backward (B; the input-gradient half where the backward splits), the
#: weight-gradient half W, and an exchange step (the engine's send/recv work around the transport's)
ACTIONS = {"F": "_forward", "B": "_backward", "W": "_weight", "send/recv step": "_communicate"}
#: Transport calls timed per call: one exchange (sends and receives of a step), one release of a received slot
TRANSPORT_CALLS = {"transport exchange": "exchange", "transport release": "release"}
#: engine shapes: small (quick to run), launch (the launch-bound pipeline shape: 32 blocks h=512, 2x256, M=16)
ENGINE_SHAPES = {
    "small": dict(layers=4, hidden=512, micro_batch_size=2, seq=256, microbatches=4),
    "launch": dict(layers=32, hidden=512, micro_batch_size=2, seq=256, microbatches=16),
    "quick": dict(layers=2, hidden=16, micro_batch_size=2, seq=8, microbatches=4),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in ENGINE_SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown engine shape {unknown[0]!r}; choose from small, launch")
    return names


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hostcost-rows", type=int, default=512, help="rows (tokens) of the op tensors")
    group.add_argument("--hostcost-hidden", type=_ints, default=(512, 2048), help="widths, comma-separated")
    group.add_argument("--hostcost-iters", type=int, default=6, help="timed eager iterations of the engine part")
    group.add_argument("--hostcost-shapes", type=_names, default=["small"],
                       help="engine shapes, comma-separated: small, launch (32 blocks h=512, 2x256, M=16)")


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    if ctx.device.type != "cuda" and not ctx.quick:
        return "needs CUDA (or --quick for the CPU smoke test)"
    return None


def _record(ctx: BenchContext, case: str, pl: float, anchor: float, anchor_name: str, sizes: dict,
            extra: dict | None = None) -> None:
    ctx.record(Record(SUITE, case, "us/call (host)", pl, anchor, anchor_name, higher_is_better=False, sizes=sizes,
                      extra=extra or {}))


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


def _timed_methods(obj: Any, methods: dict[str, str], times: dict[str, list[float]]) -> None:
    """Wrap `obj`'s methods (label -> method name) on this instance: host microseconds of every call, per label."""
    for label, name in methods.items():
        fn = getattr(obj, name, None)
        if fn is None:
            continue
        out = times.setdefault(label, [])

        def timed(*a: Any, _fn: Callable = fn, _out: list = out, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **k)
            finally:
                _out.append((time.perf_counter_ns() - t0) / 1e3)
        setattr(obj, name, timed)


def _timed_engine(rt: Any) -> dict[str, list[float]]:
    """Host microseconds of every engine action (F, B, W, the exchange step) and transport call (exchange, release)
    of the runtime's engine, and of each whole `iteration()`, as lists that fill while it trains."""
    times: dict[str, list[float]] = {}
    _timed_methods(rt.engine, ACTIONS, times)
    _timed_methods(rt.engine.transport, TRANSPORT_CALLS, times)
    _timed_methods(rt.engine, {"iteration (host)": "iteration"}, times)
    return times


def _python_calls(rt: Any) -> float:
    """Python (and builtin) function calls of one eager iteration, counted by cProfile: host work as a count that
    does not depend on the machine's load (the profile itself slows the iteration; only the count is kept)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with eager_only():  # as the runtime runs an eager iteration
        prof.enable()
        rt.engine.iteration()
        prof.disable()
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    return float(sum(v[1] for v in pstats.Stats(prof).stats.values()))


def _summarise(times: dict[str, list[float]]) -> dict[str, float]:
    """Median host microseconds per call of each action; the engine's own host time per iteration (the iteration's
    host time less every timed action in it: the loop, streams, autocast regions, bookkeeping)."""
    out = {label: statistics.median(v) for label, v in times.items() if v and label != "iteration (host)"}
    per_iter = times.get("iteration (host)", [])
    if per_iter:
        out["iteration (host)"] = statistics.median(per_iter)
        actions = sum(sum(times[label]) for label in ACTIONS if label in times)
        out["engine own (host, per iteration)"] = max(sum(per_iter) - actions, 0.0) / len(per_iter)
    return out


def _engine_config(kernels: str, p2p: str, shape: dict[str, int], ctx: BenchContext) -> Any:
    from peerline.distributed.config import RunConfig

    world = dist.get_world_size() if dist.is_initialized() else 1
    return RunConfig(**shape, stages=2 if world == 1 else 1, schedule="1f1b", kernels=kernels, p2p=p2p,
                     dtype="bf16" if ctx.device.type == "cuda" else "fp32", device=ctx.device.type, graph=False,
                     iters=10**9, log_every=10**6)


def _engine_actions(kernels: str, p2p: str, shape: dict[str, int], args: argparse.Namespace, ctx: BenchContext
                    ) -> dict[str, float]:
    """Median host microseconds per call of each engine action over the timed eager iterations, the engine's own
    time, the iteration's wall time and Python calls per iteration."""
    from peerline.bench.runtime_timing import open_runtime

    iters = 2 if ctx.quick else args.hostcost_iters
    with open_runtime(_engine_config(kernels, p2p, shape, ctx)) as rt:
        rt.train(rt.iteration + 2)  # warm-up: kernels built, allocator filled
        calls = _python_calls(rt)
        times = _timed_engine(rt)
        t0 = time.perf_counter()
        rt.train(rt.iteration + iters)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        wall = (time.perf_counter() - t0) * 1e6 / iters
        out = _summarise(times)
        out.update(_plain_torch_actions(rt, ctx))
    out["iteration (wall)"] = wall
    out["python calls per iteration"] = calls
    return out


def _plain_torch_actions(rt: Any, ctx: BenchContext) -> dict[str, float]:
    """Host microseconds of one microbatch's forward (with the loss on the last stage) and forward + backward of
    this rank's first stage module called directly, under the run's autocast: the same work without the engine
    (torch's own per-op host cost, the floor of F and B)."""
    from peerline.bench.kernel_tools import host_cost

    engine = rt.engine
    stage = engine.stages[engine.order[0]]
    b, s, h = rt.cfg.micro_batch_size, rt.cfg.seq, rt.cfg.hidden
    x = (engine.feed.inputs[0] if stage.is_first
         else torch.randn(b, s, h, device=ctx.device).requires_grad_())
    target = torch.randn(b, s, h, device=ctx.device)
    cast = engine._autocast()

    def forward() -> torch.Tensor:
        with cast:
            out = stage.module(x)
        return engine.loss_fn(out, target) if stage.is_last else out

    def both() -> None:
        out = forward()
        out.backward() if stage.is_last else out.backward(torch.ones_like(out))

    calls = 3 if ctx.quick else 10
    f = host_cost.host_us(forward, ctx.device, calls=calls, reps=3)
    fb = host_cost.host_us(both, ctx.device, calls=calls, reps=3)
    for p in stage.module.parameters():  # what the timed calls accumulated is not a training result
        if p.grad is not None:
            p.grad.zero_()
    return {"plain torch F": f, "plain torch B": max(fb - f, 0.0)}


def _engine_part(args: argparse.Namespace, ctx: BenchContext, world: int) -> None:
    """Per-action host time of the engine, --kernels auto against --kernels torch, per transport and shape; F and B
    also against the stage module called directly (plain torch eager)."""
    transports = ("copy-engine", "nccl") if world == 2 and ctx.device.type == "cuda" else ("auto",)
    shapes = ["quick"] if ctx.quick else args.hostcost_shapes
    for shape_name in shapes:
        shape = ENGINE_SHAPES[shape_name]
        for p2p in transports:
            ctx.step(f"engine actions, {shape_name} shape, p2p {p2p}")
            mine = _engine_actions("auto", p2p, shape, args, ctx)
            ref = _engine_actions("torch", p2p, shape, args, ctx)
            where = f"pp={world}, stages={2 if world == 1 else 1}, p2p {p2p}, {shape_name}"
            sizes = {**shape, "shape": shape_name}
            extra = {"python_calls_per_iter": mine.get("python calls per iteration"),
                     "anchor_python_calls_per_iter": ref.get("python calls per iteration")}
            for action, us in mine.items():
                if action.startswith("plain torch") or action == "python calls per iteration":
                    continue
                _record(ctx, f"engine {action} ({where})", us, ref.get(action, float("nan")),
                        "same run with --kernels torch", sizes, extra)
            for action in ("F", "B"):
                if action in mine and f"plain torch {action}" in mine:
                    _record(ctx, f"engine {action} vs the module called directly ({where})", mine[action],
                            mine[f"plain torch {action}"], "plain torch eager, same module", sizes, extra)
            ctx.note(f"hostcost {where}: {mine['python calls per iteration']:.0f} Python calls per eager iteration "
                     f"(--kernels torch: {ref['python calls per iteration']:.0f})")


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Op host costs, then the engine's per-action host costs (auto kernels vs torch kernels)."""
    if not hasattr(args, "hostcost_rows"):
        args.hostcost_rows, args.hostcost_hidden, args.hostcost_iters = 512, (512, 2048), 6
    if not hasattr(args, "hostcost_shapes"):
        args.hostcost_shapes = ["small"]
    if ctx.device.type == "cuda":
        _ops(args, ctx)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 2:
        ctx.note("hostcost: the engine part runs on 1 or 2 ranks; skipped")
        return
    _engine_part(args, ctx, world)
