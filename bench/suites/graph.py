"""Benchmark suite `graph`: one GPU, the whole training step captured into a CUDA graph, against torch eager and
against the same step captured by hand with torch.cuda.graph (docs/benchmarks has the figures per card).

    python launch/bench.py graph [--graph-microbatches 1]

The model is the launch-bound configuration (32 blocks of h=512, micro-batch 2x256, bf16 autocast, AdamW), run
on one device: under torchrun every rank runs the same single-GPU measurement on its own GPU (the ranks stay in
lock-step for the collective capture decision) and rank 0 reports. peerline is `Runtime` with pp=1, dp=1: eager
and graph-replayed. The anchors: torch eager (the same model written in plain PyTorch, bench/suites/plain_mlp.py,
fused AdamW) and the same step captured by hand (the warm-up / capture recipe of the torch.cuda.graph
documentation, capturable AdamW). On the CPU (--quick) only the eager variants run, as a smoke test.
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

from peerline.bench.benchkit import BenchContext, Record, Timing, time_blocks
from peerline.bench.suites.torch_pipelining import PipeShape, build_stage_module, fill
from peerline.distributed.streams import new_stream

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
DEFAULT_LOOP = 8  # iterations per host launch of the looped variant: the launch cost (60-100 us) over 8
COUNTER = "peerline graph counter-data"
LOOPED = "peerline graph loop"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--graph-microbatches", type=int, default=1, help="microbatches per step (default 1)")
    group.add_argument("--graph-loop-k", type=int, default=DEFAULT_LOOP,
                       help=f"iterations per launch of peerline's looped graph variant (--graph-loop; default "
                            f"{DEFAULT_LOOP}; 1 skips the variant)")
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


def _single_gpu_runtime(shape: PipeShape, device: torch.device, graph: bool, loop: int = 1, data: str = "seeded"):
    """peerline on this rank's device alone (pp=1, dp=1), whatever the launcher's world."""
    from peerline.distributed.config import RunConfig
    from peerline.distributed.env import LaunchInfo
    from peerline.distributed.runtime import Runtime

    local = device.index or 0
    info = LaunchInfo(rank=0, world_size=1, local_rank=local, local_world_size=1, master_addr="127.0.0.1",
                      master_port=0, launcher="single")
    cfg = RunConfig(pp=1, dp=1, microbatches=shape.microbatches, micro_batch_size=shape.micro_batch_size,
                    seq=shape.seq, hidden=shape.hidden, layers=shape.layers, seed=shape.seed, lr=shape.lr,
                    dtype=shape.dtype, device=device.type, graph=graph, iters=10**9, log_every=loop,
                    graph_loop=loop, data=data)
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


class ShapeRun:
    """The measurements of one shape: every variant's time per iteration, losses and host times."""

    def __init__(self, shape: PipeShape, args: argparse.Namespace, ctx: BenchContext) -> None:
        self.shape, self.ctx, self.device = shape, ctx, ctx.device
        self.iters = 2 if ctx.quick else 20
        self.reps = getattr(args, "reps", None) or (2 if ctx.quick else 5)
        warmup = getattr(args, "warmup", None)
        self.warmup = warmup if warmup is not None else 1
        self.timed: dict[str, Timing] = {}
        self.losses: dict[str, list[float]] = {}
        self.host_us: dict[str, dict[str, float]] = {}  # variant -> HOST_MODES mode -> us per step (load + replay)
        self.host_b2b_us: dict[str, float] = {}
        self.replay_us: dict[str, dict[str, float]] = {}  # graph variants: mode -> us per replay() call

    def measure(self, name: str, step: Callable[[], Any], loss: Callable[[], float],
                replay: Callable[[], Any] | None = None, per_call: int = 1) -> None:
        """Times `step` (which runs `per_call` iterations); every figure is stored per iteration. Every rank
        measures the same thing on its own device; time_blocks takes the slowest rank."""
        device = self.device
        self.ctx.step(f"{self.shape.name} M={self.shape.microbatches} {name}")
        self.losses[name] = []
        for _ in range(2):
            step()
            self.losses[name].append(loss())
        calls = max(5, self.iters // per_call) if per_call > 1 else self.iters
        t = time_blocks(lambda n: [step() for _ in range(n)], iters=calls, reps=self.reps, warmup=self.warmup,
                        device=device)
        self.timed[name] = Timing(t.median_ms / per_call, t.p10_ms / per_call, t.p90_ms / per_call, t.reps)
        self.host_us[name] = {mode: _median_call_us(step, calls, device, mode) / per_call for mode in HOST_MODES}
        self.host_b2b_us[name] = _host_us_back_to_back(step, calls, device) / per_call
        if replay is not None:
            self.replay_us[name] = {mode: _median_call_us(replay, calls, device, mode) / per_call
                                    for mode in HOST_MODES}


def run_shape(base: PipeShape, args: argparse.Namespace, ctx: BenchContext) -> float | None:
    """One shape: records the four comparisons; returns peerline's host microseconds per replay (None if no
    graph ran)."""
    m = getattr(args, "graph_microbatches", 1) or 1
    shape = PipeShape(base.name, base.layers, base.hidden, base.micro_batch_size, base.seq, m, base.dtype)
    on_gpu = ctx.device.type == "cuda"
    sr = ShapeRun(shape, args, ctx)
    anchor = TorchStep(shape, ctx.device)
    sr.measure("torch eager", anchor.eager_step, lambda: float(anchor.loss))
    if on_gpu:
        anchor.capture()
        sr.measure("torch graph", anchor.graph_step, lambda: float(anchor.loss), anchor.graph.replay)
    loop = getattr(args, "graph_loop_k", DEFAULT_LOOP) or 1
    # (name, graph, iterations per launch, data): seeded data is written by the host each iteration, counter data
    # is made inside the graph (--data counter), so the last two separate the data's host cost from the launch's.
    variants = [("peerline eager", False, 1, "seeded"), ("peerline graph", True, 1, "seeded"),
                (COUNTER, True, 1, "counter")] + ([(LOOPED, True, loop, "counter")] if loop > 1 else [])
    for name, graph, k, data in (variants if on_gpu else variants[:1]):
        _measure_peerline(sr, name, graph, k, data)
    if dist.is_initialized() and dist.get_world_size() > 1 and ctx.is_writer:
        ctx.note(f"graph: every one of {dist.get_world_size()} ranks ran the single-GPU step; times are the "
                 "slowest rank's")
    _record_pairs(sr)
    return _host_notes(sr, loop)


def _measure_peerline(sr: ShapeRun, name: str, graph: bool, k: int, data: str) -> None:
    """One peerline variant on this rank's device alone: eager, graph-replayed, or looped k iterations a launch."""
    ctx = sr.ctx
    rt = _single_gpu_runtime(sr.shape, sr.device, graph, k, data)
    try:
        if graph:
            rt.train(rt.cfg.warmup_iters + 1)  # capture happens after the eager warm-up iterations
            if rt.graph is None:
                ctx.note(f"graph: peerline did not capture: {rt.graph_failed}")
                return
            if rt.graph_loop != k:
                ctx.note(f"graph: peerline's looped graph was not built: {rt.graph_loop_failed}")
                return
        if k > 1:
            sr.measure(name, lambda: rt.run_looped(), lambda: rt.read_loss(), lambda: _launch_loop_on_main(rt),
                       per_call=k)
        else:
            sr.measure(name, lambda: rt.run_iteration(), lambda: rt.read_loss(),
                       (lambda: _replay_on_main(rt)) if graph else None)
    finally:
        if rt.graph is not None:
            rt.graph.release()
        rt.engine.transport.close()


def _record_pairs(sr: ShapeRun) -> None:
    """tokens/s of each (peerline variant, anchor) pair that ran, and the never-slower goal of the compute shape."""
    shape, timed, m = sr.shape, sr.timed, sr.shape.microbatches
    tokens = m * shape.micro_batch_size * shape.seq
    sizes = {**shape.sizes(), "gpus": 1}
    for mine, theirs in (("peerline eager", "torch eager"), ("peerline graph", "torch eager"),
                         ("peerline graph", "torch graph"), ("peerline graph", "peerline eager"),
                         (COUNTER, "peerline graph"), (LOOPED, "torch graph"), (LOOPED, "peerline graph")):
        if mine not in timed or theirs not in timed:
            continue
        a, b = timed[mine], timed[theirs]
        sr.ctx.record(Record(SUITE, f"{shape.name} M={m} {mine} vs {theirs}", "tokens/s",
                             tokens / (a.median_ms / 1e3), tokens / (b.median_ms / 1e3), theirs, sizes=sizes,
                             extra={"ms_per_step": a.median_ms, "anchor_ms_per_step": b.median_ms,
                                    "spread": a.spread, "anchor_spread": b.spread, "losses": sr.losses[mine],
                                    "anchor_losses": sr.losses[theirs],
                                    "max_loss_diff": _loss_diff(mine, theirs, sr.losses),
                                    "host_us_per_step": sr.host_us[mine], "anchor_host_us_per_step": sr.host_us[theirs],
                                    "host_us_back_to_back": sr.host_b2b_us[mine],
                                    "anchor_host_us_back_to_back": sr.host_b2b_us[theirs],
                                    "host_us_per_replay": sr.replay_us.get(mine),
                                    "anchor_host_us_per_replay": sr.replay_us.get(theirs),
                                    "host_modes": HOST_MODE_TEXT}))
    if shape.name.startswith("compute"):
        for variant in ("peerline graph", COUNTER, LOOPED):
            if variant in timed and "peerline eager" in timed:
                ratio = timed["peerline eager"].median_ms / timed[variant].median_ms
                sr.ctx.note(f"GOAL {'MET' if ratio >= 1.0 else 'MISSED'} {shape.name}: {variant} {ratio:.3f}x eager "
                            "(goal: never slower)")


def _host_notes(sr: ShapeRun, loop: int) -> float | None:
    """The host-time notes of the graph variants; returns the last one's host microseconds per iteration."""
    torch_host = sr.host_us.get("torch graph", {}).get("busy", float("nan"))
    torch_replay = sr.replay_us.get("torch graph", {}).get("busy", float("nan"))
    result = None
    for variant in ("peerline graph", COUNTER, LOOPED):
        if variant not in sr.replay_us:
            continue
        mine = sr.host_us[variant]
        result = us = mine["busy"]
        how = {"peerline graph": "one launch per iteration, seeded data written by the host",
               COUNTER: "one launch per iteration, --data counter (made inside the graph)",
               LOOPED: f"--graph-loop {loop} --data counter: one launch per {loop} iterations"}[variant]
        # The goal is judged on the way peerline is meant to be run for it: the looped graph when it ran.
        judged = variant == LOOPED or LOOPED not in sr.replay_us
        tag = ("GOAL " + ("MET" if us < 50 else "MISSED")) if judged else "DETAIL"
        sr.ctx.note(f"{tag} {sr.shape.name}: host time per replayed iteration, {how} (data load + launch, issued "
                    f"while the GPU runs earlier work) {us:.1f} us (goal < 50 us), torch graph {torch_host:.1f} us; "
                    f"launch alone {sr.replay_us[variant]['busy']:.1f} us per iteration (torch replay() "
                    f"{torch_replay:.1f}); device idle {mine['idle']:.1f} us, short burst {mine['burst']:.1f} us, "
                    f"back to back {sr.host_b2b_us[variant]:.1f} us per iteration (GPU-bound runs block the host "
                    f"there: torch graph {sr.host_b2b_us.get('torch graph', float('nan')):.1f})")
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Host (CPU) time of issuing one call, three ways (each a median over calls, microseconds):
#   busy   the GPU is kept busy by a spin kernel queued just before the timed call, so the call neither wakes an idle
#          device nor waits for room in a full launch queue: the cost of issuing work while the GPU runs earlier
#          work, which is what a host running ahead of its GPU pays every iteration. The goal is judged on this.
#   idle   the device is idle (synchronized) before each call: adds whatever an idle device costs the first launch.
#   burst  calls back to back after one untimed call, few enough that the queue rarely fills (GPU-bound steps can
#          still block here: the compute-bound step does, graph or not).
HOST_MODES = ("busy", "idle", "burst")
HOST_MODE_TEXT = ("busy: behind a spin kernel (GPU busy, launch queue empty); idle: device synchronized before each "
                  "call; burst: back to back after one untimed call")
SPIN_MS = 3.0  # longer than the host work timed behind it, far shorter than a full launch queue


_SPIN_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _spin(device: torch.device, ms: float = SPIN_MS) -> None:
    """Keep the device busy for about `ms` (torch's own spin kernel) on a stream of its own (role: the benchmark's
    spin), so the timed call queues nothing behind it and nothing runs on the legacy default stream."""
    if device.type != "cuda":
        return
    if device not in _SPIN_STREAMS:
        _SPIN_STREAMS[device] = new_stream(device)
    # kHz = cycles per ms; CUDA 13 builds may not report it (cudaDeviceProp lost clockRate): assume 2 GHz
    rate_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000
    with torch.cuda.stream(_SPIN_STREAMS[device]):
        torch.cuda._sleep(int(ms * rate_khz))


def _median_call_us(call: Callable[[], Any], n: int, device: torch.device, mode: str = "busy") -> float:
    """Median host microseconds of one call() over n calls, in one of HOST_MODES (see there)."""
    if mode not in HOST_MODES:
        raise ValueError(f"host timing mode {mode!r}: expected one of {HOST_MODES}")
    _sync(device)
    if mode == "burst":
        call()
    samples = []
    for _ in range(n):
        if mode != "burst":
            _sync(device)
        if mode == "busy":
            _spin(device)
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    return statistics.median(samples)


def _launch_loop_on_main(rt) -> None:
    """peerline's looped launch alone (the ring already holds data; the slot is 0 after every loop)."""
    with torch.cuda.stream(rt.engine.main_stream):
        rt.graph.loop.launch()


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
