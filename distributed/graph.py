"""Whole-iteration CUDA graphs: capture one full training iteration of this rank and replay it.

What is captured: every microbatch forward and backward of the rank's schedule, the handoffs (copy-engine flag
waits/writes and copies, or NCCL send/recv), the gradient all-reduces, the optimizer step (capturable AdamW) and
the loss accumulation, i.e. exactly what `Engine.iteration()` issues. The data load stays outside: before each
replay the runtime refills the static input/target buffers in place.

Lessons followed (ARCHITECTURE.md): eager warm-up first (NCCL and P2P included), barrier and synchronize before
capture, capture on the engine's own (non-default) main stream so work on the other streams forks from it and
joins back, thread-local capture mode, one memory pool, and all ranks decide together: if any rank's capture
fails, every rank runs eager and says why.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .engine import Engine

log = logging.getLogger(__name__)


class IterationGraph:
    """One captured iteration of an Engine."""

    def __init__(self, engine: Engine) -> None:
        if engine.main_stream is None:
            raise ValueError("CUDA graphs need a CUDA device")
        self.engine = engine
        self.graph = torch.cuda.CUDAGraph()

    def capture(self) -> None:
        main = self.engine.main_stream
        timeline = self.engine.timeline
        recording, timeline.enabled = timeline.enabled, False  # timing events stay out of the graph
        try:
            with torch.cuda.graph(self.graph, stream=main, capture_error_mode="thread_local"):
                self.engine.iteration()
        finally:
            timeline.enabled = recording

    def replay(self) -> None:
        """Launch the captured iteration on the current stream's device (one host call)."""
        self.graph.replay()


def agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says ok (a MIN all-reduce); a single process decides alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)  # int32: NCCL reduces it, unlike bool
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def try_capture(engine: Engine, device: torch.device) -> tuple[IterationGraph | None, str | None]:
    """Capture the engine's iteration on every rank together. Returns (graph, None) or (None, reason)."""
    if dist.is_initialized():
        dist.barrier()
    torch.cuda.synchronize(device)
    reason = None
    graph = None
    try:
        graph = IterationGraph(engine)
        graph.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        graph = None
        for stage in engine.stages.values():
            stage.clear()
        reset = getattr(engine.transport, "reset", None)
        if reset is not None:  # forget host bookkeeping of handoffs the failed capture issued
            reset()
        log.warning("CUDA graph capture failed on this rank: %s", reason)
    torch.cuda.synchronize(device)
    if not agree(reason is None, device):
        return None, reason or "capture failed on another rank"
    return graph, None
