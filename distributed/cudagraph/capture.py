"""Whole-iteration CUDA graphs: capture one full training iteration of this rank and replay it.

What is captured: every microbatch forward and backward of the rank's schedule, the handoffs (copy-engine flag
waits/writes and copies, or NCCL send/recv), the gradient all-reduces, the optimizer step (capturable AdamW) and
the loss accumulation, i.e. exactly what `Engine.iteration()` issues. Data: with the default seeded data the host
refills the static input/target buffers in place before each replay (or, for a loop, a device ring the graph copies
from); with `--data counter` the graph makes its own data from a device-side counter. `--graph-loop K` wraps the
captured iteration into a looped graph, K iterations per host launch (graph_loop.py).

Lessons followed (ARCHITECTURE.md): eager warm-up first (NCCL and P2P included), barrier and synchronize before
capture, capture on the engine's own (non-default) main stream so work on the other streams forks from it and
joins back, thread-local capture mode, one memory pool, and all ranks decide together: if any rank's capture
fails, every rank runs eager and says why.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from peerline.distributed.cudagraph.loop import DataRing, GraphLoop
from peerline.distributed.pipeline.engine import CounterDataFeed, DataFeed, Engine

log = logging.getLogger(__name__)


class IterationGraph:
    """One captured iteration of an Engine; with `loop` > 1 also a looped graph that runs `loop` iterations per host
    launch (graph_loop.py), the iteration then reading its data from a device-side ring."""

    def __init__(self, engine: Engine, loop: int = 1) -> None:
        if engine.main_stream is None:
            raise ValueError("CUDA graphs need a CUDA device")
        if loop < 1:
            raise ValueError(f"--graph-loop must be >= 1, got {loop}")
        self.engine = engine
        self.loop_iterations = loop
        # How the graph gets its data: counter data is made inside the graph; seeded data is written by the host,
        # into the static buffers (one launch per iteration) or, for a loop, into a device-side ring of K slots.
        self.counter_feed = isinstance(engine.feed, CounterDataFeed)
        self.ring = None
        if loop > 1 and not self.counter_feed:
            if type(engine.feed) is not DataFeed:
                raise ValueError(f"--graph-loop needs data generated on the device, not {type(engine.feed).__name__}")
            self.ring = DataRing(engine.feed, loop, engine.device)
        # The loop's iteration count within a launch (the ring's slot when there is a ring).
        self.slot = self.ring.slot if self.ring is not None else torch.zeros(1, dtype=torch.int64,
                                                                            device=engine.device)
        # A looped graph embeds the captured cudaGraph_t, so torch must keep it after capture (keep_graph).
        self.graph = _torch_graph(keep=loop > 1)
        self.loop: GraphLoop | None = None

    def capture(self) -> None:
        main = self.engine.main_stream
        timeline = self.engine.timeline
        feed = self.engine.feed
        recording, timeline.enabled = timeline.enabled, False  # timing events stay out of the graph
        try:
            with torch.cuda.graph(self.graph, stream=main, capture_error_mode="thread_local"):
                if self.counter_feed:
                    feed.generate()
                    feed.advance()
                elif self.ring is not None:
                    self.ring.copy_to_static()
                self.engine.iteration()
        finally:
            timeline.enabled = recording
        if self.loop_iterations > 1 and hasattr(self.graph, "instantiate"):
            self.graph.instantiate()  # keep_graph defers it to the first replay otherwise

    def build_loop(self) -> None:
        """Wrap the captured iteration into the looped graph (raises with CUDA's reason if it cannot be looped)."""
        if self.loop_iterations < 2:
            raise ValueError("this iteration was captured for one launch per iteration (--graph-loop 1)")
        self.loop = GraphLoop(self.graph.raw_cuda_graph(), self.slot, self.loop_iterations, self.engine.main_stream)

    def load(self, iteration: int) -> None:
        """Prepare the data of the next single replay (on the current stream): point the counter at it (counter
        data), write it into ring slot 0 (a loop's ring), or into the static buffers."""
        if self.counter_feed:
            self.engine.feed.set_iteration(iteration)
        elif self.ring is not None:
            self.ring.load(iteration, 1)
        else:
            self.engine.feed.load(iteration)

    def replay(self) -> None:
        """Launch the captured iteration on the current stream's device (one host call)."""
        self.graph.replay()
        if self.counter_feed:
            self.engine.feed.advanced(1)

    def run_loop(self, first_iteration: int) -> int:
        """Prepare and run `loop` iterations from one launch; returns how many ran."""
        k = self.loop_iterations
        if self.counter_feed:
            self.engine.feed.set_iteration(first_iteration)
        else:
            self.ring.load(first_iteration, k)
        self.loop.launch()
        if self.counter_feed:
            self.engine.feed.advanced(k)
        return k

    def release(self) -> None:
        """Free the looped graph (the torch graph goes with this object)."""
        if self.loop is not None:
            self.loop.release()
            self.loop = None


def _torch_graph(keep: bool) -> torch.cuda.CUDAGraph:
    """torch.cuda.CUDAGraph, keeping its cudaGraph_t after capture when asked (torch >= 2.8: keep_graph; older
    torch keeps it in debug mode)."""
    if not keep:
        return torch.cuda.CUDAGraph()
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        graph = torch.cuda.CUDAGraph()
        graph.enable_debug_mode()
        return graph


def agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok (a MIN all-reduce); a single process decides alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)  # int32: NCCL reduces it, unlike bool
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def try_capture(engine: Engine, device: torch.device, loop: int = 1
                ) -> tuple[IterationGraph | None, str | None, str | None]:
    """Capture the engine's iteration on every rank together; with `loop` > 1 also build the looped graph.
    Returns (graph, None, loop_problem) or (None, reason, None). loop_problem says why the graph replays one
    iteration per launch although a loop was asked for (decided by every rank together, like the capture)."""
    if dist.is_initialized():
        dist.barrier()
    torch.cuda.synchronize(device)
    reason = None
    graph = None
    try:
        graph = IterationGraph(engine, loop)
        graph.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
        reason = _one_line(exc)
        graph = None
        for stage in engine.stages.values():
            stage.clear()
        reset = getattr(engine.transport, "reset", None)
        if reset is not None:  # forget host bookkeeping of handoffs the failed capture issued
            reset()
        log.warning("CUDA graph capture failed on this rank: %s", reason)
    torch.cuda.synchronize(device)
    if not agree(reason is None, device):
        return None, reason or "capture failed on another rank", None
    loop_problem = None
    if loop > 1:
        try:
            graph.build_loop()
        except Exception as exc:  # noqa: BLE001 - the iteration replays one per launch instead, and says why
            loop_problem = _one_line(exc)
            log.warning("CUDA graph loop not built on this rank: %s", loop_problem)
        torch.cuda.synchronize(device)
        if not agree(loop_problem is None, device):
            graph.release()
            loop_problem = loop_problem or "the loop could not be built on another rank"
    return graph, None, loop_problem


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
