"""Benchmark suite `graph`: one GPU, the whole training step captured into a CUDA graph, against torch eager and
against the same step captured by hand with torch.cuda.graph (ARCHITECTURE.md measured 11.8 ms eager and
3.15 ms graphed on an H200 for the launch-bound model with one microbatch + AdamW).

    python launch/bench.py graph [--graph-microbatches 1]

The model is the launch-bound configuration (32 blocks of h=512, micro-batch 2x256, bf16 autocast, AdamW), run
on one device: under torchrun every rank runs the same single-GPU measurement on its own GPU (the ranks stay in
lock-step for the collective capture decision) and rank 0 reports. peerline is `Runtime` with pp=1, dp=1: eager
and graph-replayed. The anchors: torch eager (the same modules with torch kernels, fused AdamW) and the same step
captured by hand (the warm-up / capture recipe of the torch.cuda.graph documentation, capturable AdamW). On the
CPU (--quick) only the eager variants run, as a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from peerline.launch.benchkit import BenchContext, Record, Timing, time_blocks
from peerline.launch.suites.torch_pipelining import PipeShape, build_stage_module, fill

log = logging.getLogger(__name__)

SUITE = "graph"
SHAPES = {
    "launch": PipeShape("launch-bound", layers=32, hidden=512, micro_batch_size=2, seq=256, microbatches=1,
                        dtype="bf16"),
    # Twice the layers of the launch-bound step: the host time per replay must not grow with the layer count.
    "launch64": PipeShape("launch-bound 64 layers", layers=64, hidden=512, micro_batch_size=2, seq=256,
                          microbatches=1, dtype="bf16"),
    # The compute-bound stage of the pipeline suite (8 of its 16 blocks, one microbatch): graphs must never be
    # slower than eager here.
    "compute": PipeShape("compute-bound", layers=8, hidden=2048, micro_batch_size=8, seq=512, microbatches=1,
                         dtype="bf16"),
    "quick": PipeShape("quick", layers=4, hidden=32, micro_batch_size=2, seq=8, microbatches=1, dtype="fp32"),
}
DEFAULT_SHAPES = "launch,launch64,compute"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--graph-microbatches", type=int, default=1, help="microbatches per step (default 1)")
    group.add_argument("--graph-shapes", default=DEFAULT_SHAPES,
                       help=f"comma list of {', '.join(k for k in SHAPES if k != 'quick')} "
                            f"(default {DEFAULT_SHAPES}; --quick runs a tiny CPU shape)")


class TorchStep:
    """The anchor: the same modules (torch kernels), MSE, fused AdamW, microbatches accumulated; eager or captured
    by hand. Data is refilled in place before each step, as peerline's feed does."""

    def __init__(self, shape: PipeShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        self.module = build_stage_module(shape, 1, 0).to(device)
        on_gpu = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=shape.lr, fused=on_gpu or None,
                                           capturable=on_gpu)
        mb = (shape.micro_batch_size, shape.seq, shape.hidden)
        self.inputs = [torch.empty(mb, device=device) for _ in range(shape.microbatches)]
        self.targets = [torch.empty(mb, device=device) for _ in range(shape.microbatches)]
        self.loss = torch.zeros((), device=device)
        self.generator = torch.Generator(device=device)
        self.iteration = 0
        self.graph: torch.cuda.CUDAGraph | None = None

    def _cast(self) -> contextlib.AbstractContextManager:
        if self.shape.dtype != "bf16":
            return contextlib.nullcontext()
        # The autocast weight-cast cache stays off in the captured step (the torch.cuda graph docs' advice for
        # autocast with graphs); eager steps keep torch's default.
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.graph is None)

    def load(self) -> None:
        for mb in range(self.shape.microbatches):
            fill(self.inputs[mb], self.shape, self.iteration, mb, 0, self.generator)
            fill(self.targets[mb], self.shape, self.iteration, mb, 1, self.generator)

    def _body(self) -> None:
        self.loss.zero_()
        m = self.shape.microbatches
        for x, t in zip(self.inputs, self.targets, strict=True):
            with self._cast():
                out = self.module(x)
            loss = F.mse_loss(out.float(), t) / m
            loss.backward()
            self.loss.add_(loss.detach())
        self.optimizer.step()

    def eager_step(self) -> None:
        self.load()
        self.optimizer.zero_grad(set_to_none=True)
        self._body()
        self.iteration += 1

    def capture(self, warmup: int = 3) -> None:
        """The torch.cuda.graph recipe: warm up on a side stream, grads to None, capture the step."""
        side = torch.cuda.Stream(self.device)  # the anchor's own stream, as a user of torch.cuda.graph writes it
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.eager_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()  # set before capture: _cast() sees it
        with torch.cuda.graph(self.graph):
            self._body()

    def graph_step(self) -> None:
        self.load()
        self.graph.replay()
        self.iteration += 1


def _single_gpu_runtime(shape: PipeShape, device: torch.device, graph: bool):
    """peerline on this rank's device alone (pp=1, dp=1), whatever the launcher's world."""
    from peerline.distributed.config import RunConfig
    from peerline.distributed.env import LaunchInfo
    from peerline.distributed.runtime import Runtime

    local = device.index or 0
    info = LaunchInfo(rank=0, world_size=1, local_rank=local, local_world_size=1, master_addr="127.0.0.1",
                      master_port=0, launcher="single")
    cfg = RunConfig(pp=1, dp=1, microbatches=shape.microbatches, micro_batch_size=shape.micro_batch_size,
                    seq=shape.seq, hidden=shape.hidden, layers=shape.layers, seed=shape.seed, lr=shape.lr,
                    dtype=shape.dtype, device=device.type, graph=graph, iters=10**9, log_every=1)
    return Runtime.create(cfg, info)


def selected_shapes(args: argparse.Namespace, quick: bool) -> list[PipeShape]:
    """The shapes named by --graph-shapes (one clear error for an unknown name)."""
    if quick:
        return [SHAPES["quick"]]
    names = [n.strip() for n in (getattr(args, "graph_shapes", None) or DEFAULT_SHAPES).split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES or n == "quick"]
    if unknown or not names:
        known = ", ".join(k for k in SHAPES if k != "quick")
        raise SystemExit(f"bench graph: unknown --graph-shapes {','.join(unknown) or '(empty)'}; known: {known}")
    return [SHAPES[n] for n in names]


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """peerline eager / graph vs torch eager / hand-captured graph, one GPU per rank, for each shape."""
    host_graph_us: dict[str, float] = {}
    for base in selected_shapes(args, ctx.quick):
        us = run_shape(base, args, ctx)
        if us is not None:
            host_graph_us[base.name] = us
    if len(host_graph_us) > 1:
        worst = max(host_graph_us.values())
        ctx.note(f"GOAL {'MET' if worst < 50 else 'MISSED'} host time per graph replay across shapes: "
                 + ", ".join(f"{k} {v:.1f} us" for k, v in host_graph_us.items()) + " (goal < 50 us for any layer "
                 "count)")


def run_shape(base: PipeShape, args: argparse.Namespace, ctx: BenchContext) -> float | None:
    """One shape: records the four comparisons; returns peerline's host microseconds per replay (None if no
    graph ran)."""
    m = getattr(args, "graph_microbatches", 1) or 1
    shape = PipeShape(base.name, base.layers, base.hidden, base.micro_batch_size, base.seq, m, base.dtype)
    device, on_gpu = ctx.device, ctx.device.type == "cuda"
    iters = 2 if ctx.quick else 20
    reps = getattr(args, "reps", None) or (2 if ctx.quick else 5)
    warmup = getattr(args, "warmup", None)
    warmup = warmup if warmup is not None else 1
    tokens = m * shape.micro_batch_size * shape.seq
    # Every rank measures the same thing on its own device; time_blocks takes the slowest rank.
    timed: dict[str, Timing] = {}
    losses: dict[str, list[float]] = {}
    host_us: dict[str, float] = {}
    host_b2b_us: dict[str, float] = {}
    replay_us: dict[str, float] = {}

    def measure(name: str, step: Callable[[], Any], loss: Callable[[], float],
                replay: Callable[[], Any] | None = None) -> None:
        ctx.step(f"{shape.name} M={m} {name}")
        losses[name] = []
        for _ in range(2):
            step()
            losses[name].append(loss())
        timed[name] = time_blocks(lambda n: [step() for _ in range(n)], iters=iters, reps=reps, warmup=warmup,
                                  device=device)
        host_us[name] = _median_call_us(step, iters, device, idle_each=True)
        host_b2b_us[name] = _host_us_back_to_back(step, iters, device)
        if replay is not None:
            replay_us[name] = _median_call_us(replay, 8, device, idle_each=False)

    anchor = TorchStep(shape, device)
    measure("torch eager", anchor.eager_step, lambda: float(anchor.loss))
    if on_gpu:
        anchor.capture()
        measure("torch graph", anchor.graph_step, lambda: float(anchor.loss), anchor.graph.replay)
    for graph in ([False, True] if on_gpu else [False]):
        rt = _single_gpu_runtime(shape, device, graph)
        try:
            name = "peerline graph" if graph else "peerline eager"
            if graph:
                rt.train(rt.cfg.warmup_iters + 1)  # capture happens after the eager warm-up iterations
                if rt.graph is None:
                    ctx.note(f"graph: peerline did not capture: {rt.graph_failed}")
                    continue
            measure(name, lambda rt=rt: rt.run_iteration(), lambda rt=rt: rt.read_loss(),
                    (lambda rt=rt: _replay_on_main(rt)) if graph else None)
        finally:
            rt.engine.transport.close()
    if dist.is_initialized() and dist.get_world_size() > 1 and ctx.is_writer:
        ctx.note(f"graph: every one of {dist.get_world_size()} ranks ran the single-GPU step; times are the "
                 "slowest rank's")
    sizes = {**shape.sizes(), "gpus": 1}
    for mine, theirs in (("peerline eager", "torch eager"), ("peerline graph", "torch eager"),
                         ("peerline graph", "torch graph"), ("peerline graph", "peerline eager")):
        if mine not in timed or theirs not in timed:
            continue
        a, b = timed[mine], timed[theirs]
        ctx.record(Record(SUITE, f"{shape.name} M={m} {mine} vs {theirs}", "tokens/s",
                          tokens / (a.median_ms / 1e3), tokens / (b.median_ms / 1e3), theirs, sizes=sizes,
                          extra={"ms_per_step": a.median_ms, "anchor_ms_per_step": b.median_ms,
                                 "spread": a.spread, "anchor_spread": b.spread, "losses": losses[mine],
                                 "anchor_losses": losses[theirs], "max_loss_diff": _loss_diff(mine, theirs, losses),
                                 "host_us_per_step": host_us[mine], "anchor_host_us_per_step": host_us[theirs],
                                 "host_us_back_to_back": host_b2b_us[mine],
                                 "anchor_host_us_back_to_back": host_b2b_us[theirs],
                                 "host_us_per_replay": replay_us.get(mine),
                                 "anchor_host_us_per_replay": replay_us.get(theirs)}))
    if "peerline graph" in timed and "peerline eager" in timed and shape.name.startswith("compute"):
        ratio = timed["peerline eager"].median_ms / timed["peerline graph"].median_ms
        ctx.note(f"GOAL {'MET' if ratio >= 1.0 else 'MISSED'} {shape.name}: graph {ratio:.3f}x eager "
                 "(goal: never slower)")
    if "peerline graph" not in replay_us:
        return None
    us = replay_us["peerline graph"]
    ctx.note(f"GOAL {'MET' if us < 50 else 'MISSED'} {shape.name}: host time per graph replay {us:.1f} us (goal < 50 "
             f"us), torch graph {replay_us.get('torch graph', float('nan')):.1f} us; a whole iteration (data load + "
             f"replay) issued with the device idle {host_us['peerline graph']:.1f} us, back to back "
             f"{host_b2b_us['peerline graph']:.1f} us (torch graph {host_us.get('torch graph', float('nan')):.1f} / "
             f"{host_b2b_us.get('torch graph', float('nan')):.1f} us)")
    return us


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_call_us(call: Callable[[], Any], n: int, device: torch.device, *, idle_each: bool) -> float:
    """Median host (CPU) microseconds of one call(), over n.

    idle_each=True: the device is idle before each call, so this is the cost of issuing it (a step: data load +
    replay, or every eager launch), not time spent blocked behind a full launch queue. A GPU-bound run issued back
    to back blocks the host whatever issues it (seen on an H200 for the compute-bound step, graph or not): that is
    `_host_us_back_to_back`, kept for information.
    idle_each=False: the calls go back to back after one untimed call (the GPU busy, so no wake-up after idle; few
    enough that the launch queue never fills): the host cost of a graph replay call."""
    _sync(device)
    if not idle_each:
        call()
    samples = []
    for _ in range(n):
        if idle_each:
            _sync(device)
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    return statistics.median(samples)


def _replay_on_main(rt) -> None:
    """peerline's replay alone (no data load), on the runtime's main stream as run_iteration issues it."""
    with torch.cuda.stream(rt.engine.main_stream):
        rt.graph.replay()


def _host_us_back_to_back(step: Callable[[], Any], n: int, device: torch.device) -> float:
    """Host microseconds per step when n steps are issued without waiting (the device idle at the start)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    us = (time.perf_counter() - t0) * 1e6 / n
    _sync(device)
    return us


def _loss_diff(mine: str, theirs: str, losses: dict[str, list[float]]) -> float | None:
    """Both eager variants start from the same weights at iteration 0: their first losses must agree (to rounding
    in fp32; bf16 and peerline's kernels differ slightly). Other pairs ran from different iterations."""
    if (mine, theirs) != ("peerline eager", "torch eager"):
        return None
    return max(abs(x - y) for x, y in zip(losses[mine], losses[theirs], strict=True))
