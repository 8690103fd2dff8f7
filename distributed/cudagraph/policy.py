"""When and whether a rank's iteration runs as a CUDA graph, and how many iterations one host launch runs.

`GraphPolicy.plan` is called once per launch by the runtime: after the eager warm-up iterations it captures the
iteration (every rank at the same iteration, all ranks agreeing: if any rank's capture fails, every rank runs
eager and says why), then sizes the launch: K iterations of a looped graph (--graph-loop K) when they end at or
before the next iteration that must end a launch, else one. The mechanisms live beside it: capture.py (one
captured iteration) and loop.py (the looped graph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from peerline.distributed.cudagraph.capture import IterationGraph
from peerline.distributed.pipeline.engine import Engine

log = logging.getLogger(__name__)

ASYNC_ALLOCATOR_REASON = "CUDA graphs are not used with --allocator async (cudaMallocAsync) yet"


def iterations_this_launch(iteration: int, target: int, stops: tuple[int, ...], loop: int,
                           timeline_last: bool) -> int:
    """How many iterations the next launch runs: `loop` (a looped graph's K) when K iterations end at or before the
    next iteration that must end a launch (a multiple of any of `stops`: the loss read, a checkpoint) and the end
    of training, and the last iteration is not the eager one a timeline records; else 1."""
    if loop <= 1:
        return 1
    next_stop = min([target] + [(iteration // every + 1) * every for every in stops if every > 0])
    end = target - 1 if timeline_last else target
    return loop if iteration + loop <= min(next_stop, end) else 1


@dataclass(frozen=True)
class Launch:
    """The next launch: `n` iterations; `eager` runs it without the graph (the timeline's recorded iteration)."""

    n: int
    eager: bool


class GraphPolicy:
    """This rank's graph state: the captured iteration (`graph`), why there is none (`failed`) or why it replays
    one iteration per launch although a loop was asked for (`loop_failed`), and the notices to print at start."""

    def __init__(self, *, device: torch.device, rank: int, graph: bool | None, warmup_iters: int, loop: int,
                 eager_last: bool) -> None:
        self.device, self.rank = device, rank
        self.wanted = device.type == "cuda" and graph is not False
        self.warmup_iters, self.loop = warmup_iters, loop
        self.eager_last = eager_last  # a timeline records the last iteration, eagerly (no timing events in graphs)
        self.graph: IterationGraph | None = None
        self.failed: str | None = None
        self.loop_failed: str | None = None
        self.notices: list[str] = []
        if device.type != "cuda" and graph:
            self.notices.append("--graph is ignored on the CPU (CUDA graphs need a GPU); running eager")
        if device.type != "cuda" and loop > 1:
            self.notices.append(f"--graph-loop {loop} is ignored on the CPU (it loops a CUDA graph); "
                                "running one iteration at a time")

    def disable(self, notice: str) -> None:
        """Run eager from now on, with `notice` (kept only when graphs were wanted)."""
        if self.wanted:
            self.wanted = False
            self.notices.append(notice)

    @property
    def loop_iterations(self) -> int:
        """Iterations one host launch runs now: K once the looped graph is built (--graph-loop K), else 1."""
        return self.graph.loop_iterations if self.graph is not None and self.graph.loop is not None else 1

    def plan(self, engine: Engine, iteration: int, iterations_run: int, target: int,
             stops: tuple[int, ...]) -> Launch:
        """Capture when due, then size the launch that starts after `iteration` (training ends at `target`)."""
        self.maybe_capture(engine, iterations_run)
        n = iterations_this_launch(iteration, target, stops, self.loop_iterations, timeline_last=self.eager_last)
        return Launch(n, eager=self.eager_last and iteration + 1 == target)

    def maybe_capture(self, engine: Engine, iterations_run: int) -> None:
        """After `warmup_iters` eager iterations of this process, capture the iteration (every rank together)."""
        if not self.wanted or self.graph is not None or self.failed is not None:
            return
        if iterations_run < self.warmup_iters:
            return
        if torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync":
            # Capture under cudaMallocAsync failed with "capturing stream has unjoined work" and the eager fallback
            # then aborted: graphs are refused up front, with the reason, on every rank alike.
            self.failed = ASYNC_ALLOCATOR_REASON
            self._say(f"running eager: {self.failed}")
            return
        self.graph, reason, loop_problem = try_capture(engine, self.device, loop=self.loop)
        if self.graph is None:
            self.failed = reason
            self._say(f"CUDA graph capture failed, running eager on every rank: {reason}")
        elif loop_problem is not None:
            self.loop_failed = loop_problem
            self._say(f"--graph-loop {self.loop} not used, replaying one iteration per launch on every rank: "
                      f"{loop_problem}")

    def release(self) -> None:
        """Drop the graph (it holds the NCCL communicators it captured: release it before their teardown)."""
        if self.graph is not None:
            self.graph.release()
        self.graph = None

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(f"peerline: {message}", flush=True)


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
    graph, reason = _capture_here(engine, loop)
    torch.cuda.synchronize(device)
    if not agree(reason is None, device):
        return None, reason or "capture failed on another rank", None
    loop_problem = _build_loop_everywhere(graph, device) if loop > 1 else None
    return graph, None, loop_problem


def _capture_here(engine: Engine, loop: int) -> tuple[IterationGraph | None, str | None]:
    """This rank's capture: (graph, None), or (None, reason) with the failed capture's host state cleared."""
    try:
        graph = IterationGraph(engine, loop)
        graph.capture()
        return graph, None
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
        reason = one_line(exc)
        for stage in engine.stages.values():
            stage.clear()
        reset = getattr(engine.transport, "reset", None)  # only transports with host-side handoff bookkeeping
        if reset is not None:  # forget host bookkeeping of handoffs the failed capture issued
            reset()
        log.warning("CUDA graph capture failed on this rank: %s", reason)
        return None, reason


def _build_loop_everywhere(graph: IterationGraph, device: torch.device) -> str | None:
    """Build the looped graph on every rank, or on none: None when built, else why not."""
    problem = None
    try:
        graph.build_loop()
    except Exception as exc:  # noqa: BLE001 - the iteration replays one per launch instead, and says why
        problem = one_line(exc)
        log.warning("CUDA graph loop not built on this rank: %s", problem)
    torch.cuda.synchronize(device)
    if not agree(problem is None, device):
        graph.release()
        problem = problem or "the loop could not be built on another rank"
    return problem


def one_line(exc: BaseException) -> str:
    """'TypeName: first line of the message'."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
