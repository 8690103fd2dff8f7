"""Whole-iteration CUDA graphs: capture one full training iteration of this rank and replay it.

What is captured: every microbatch forward and backward of the rank's schedule, the handoffs (copy-engine flag
waits/writes and copies, or NCCL send/recv), the gradient all-reduces, the optimizer step (capturable AdamW) and
the loss accumulation, i.e. exactly what `Engine.iteration()` issues. Data: with the default seeded data the host
refills the static input/target buffers in place before each replay (or, for a loop, a device ring the graph copies
from); with `--data counter` the graph makes its own data from a device-side counter. `--graph-loop K` wraps the
captured iteration into a looped graph, K iterations per host launch (loop.py).

Lessons followed (ARCHITECTURE.md): eager warm-up first (NCCL and P2P included), barrier and synchronize before
capture, capture on the engine's own (non-default) main stream so work on the other streams forks from it and
joins back, thread-local capture mode, one memory pool. When to capture, and the agreement of every rank on the
outcome, is policy.py's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from peerline.distributed.cudagraph import memset_nodes
from peerline.distributed.cudagraph.loop import DataRing, GraphLoop
from peerline.distributed.observe.timeline import Timeline
from peerline.distributed.pipeline.engine import CounterDataFeed, DataFeed, Engine

log = logging.getLogger(__name__)


class IterationGraph:
    """One captured iteration of an Engine; with `loop` > 1 also a looped graph that runs `loop` iterations per host
    launch (loop.py), the iteration then reading its data from a device-side ring."""

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
        # A looped graph embeds the captured cudaGraph_t, and the small memsets are edited in it before it is
        # instantiated (memset_nodes.py), so torch must keep it after capture (keep_graph).
        self.edit_memsets = memset_nodes.wanted()
        self.graph, self.kept = _torch_graph(keep=loop > 1 or self.edit_memsets)
        self.edit_memsets = self.edit_memsets and self.kept
        self.memsets_replaced = 0
        self._memset_packs: list = []  # the replacing kernel nodes' arguments, kept with the graph
        self.loop: GraphLoop | None = None

    def capture(self) -> None:
        """Capture one iteration of the engine (with its data step: counter data or the ring's copy) on its main
        stream. The timeline records nothing meanwhile: timing events stay out of the graph."""
        main = self.engine.main_stream
        feed = self.engine.feed
        with _not_recording(self.engine.timeline), torch.cuda.graph(self.graph, stream=main,
                                                                      capture_error_mode="thread_local"):
            if self.counter_feed:
                feed.generate()
                feed.advance()
            elif self.ring is not None:
                self.ring.copy_to_static()
            self.engine.iteration()
        if self.edit_memsets:
            self.memsets_replaced, self._memset_packs = memset_nodes.replace_small_memsets(
                self.graph.raw_cuda_graph(), self.engine.device.index)
            log.info("captured iteration: %d small memset nodes replaced by kernel nodes", self.memsets_replaced)
        if self.kept:
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


@contextlib.contextmanager
def _not_recording(timeline: Timeline) -> Iterator[None]:
    """The timeline's recording switched off for the duration (a timeline is enabled or not by its flag)."""
    recording, timeline.enabled = timeline.enabled, False
    try:
        yield
    finally:
        timeline.enabled = recording


def _torch_graph(keep: bool) -> tuple[torch.cuda.CUDAGraph, bool]:
    """(torch.cuda.CUDAGraph, whether it keeps its cudaGraph_t uninstantiated after capture): when asked, torch >=
    2.8 keeps it (keep_graph) and instantiates on request; older torch keeps it in debug mode, instantiated."""
    if not keep:
        return torch.cuda.CUDAGraph(), False
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        graph = torch.cuda.CUDAGraph()
        graph.enable_debug_mode()
        return graph, False
