"""`--profile DIR` and `--nvtx`: where the stages show in torch.profiler traces and in Nsight Systems.

`Profiler` (every rank) traces a few iterations after warm-up with torch.profiler and writes them, in the Chrome /
TensorBoard trace format (`rank<k>.<id>.pt.trace.json`), to DIR/rank<k>. A CUDA graph replay shows as one launch,
so a profiled run is eager: the hook turns graphs off before the first iteration. `StepRanges` marks every
forward, backward, send / receive and optimizer step of the engine: NVTX ranges on a GPU (`--nvtx`, or
--profile), profiler labels with --profile; the engine's marks stay no-ops otherwise.

torch.profiler's own lines (`USDT: ... profiler_start`, `STAGE: ... Completed Stage`) are silenced, so they do not
mix with the run's lines: KINETO_LOG_LEVEL=6 unless the user set it (KINETO_LOG_LEVEL=4 shows kineto's errors).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from peerline import overrides
from peerline.distributed.hooks import IterationHooks

PROFILED_ITERATIONS = 3  # traced iterations
QUIET_KINETO = "6"  # above every kineto log level, USDT (5) included
SKIPPED_ITERATIONS = 2  # iterations before them: one not traced at all, one traced and dropped (the warm-up)


def profile_window(iterations_left: int) -> tuple[int, int, int]:
    """(wait, warmup, active) of torch.profiler.schedule for a run of `iterations_left` iterations: 3 traced
    after 2 skipped when there are enough, else as many traced as there are, after as many skipped as fit."""
    active = max(1, min(PROFILED_ITERATIONS, iterations_left))
    skipped = max(0, min(SKIPPED_ITERATIONS, iterations_left - active))
    warmup = min(1, skipped)
    return skipped - warmup, warmup, active


class Profiler(IterationHooks):
    """torch.profiler over the iterations `profile_window` picks, written to `root`/rank<k> (every rank)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.prof: torch.profiler.profile | None = None
        self.window: tuple[int, int] = (0, 0)  # first and last traced iteration

    def on_train_start(self, rt: Any) -> None:
        left = rt.cfg.iters - rt.iteration
        if left <= 0:
            return  # nothing to train (a finished run resumed): nothing to trace
        rt.graphs.disable("CUDA graph off: --profile traces eager iterations (a graph replay is one launch)")
        wait, warmup, active = profile_window(left)
        first = rt.iteration + wait + warmup + 1
        self.window = (first, first + active - 1)
        overrides.set_default("KINETO_LOG_LEVEL", QUIET_KINETO)  # read when the profiler first starts
        activities = [torch.profiler.ProfilerActivity.CPU]
        if rt.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out = os.path.join(self.root, f"rank{rt.info.rank}")
        self.prof = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{rt.info.rank}"))
        self.prof.start()
        if rt.info.rank == 0:
            print(f"peerline: profiling iterations {self.window[0]}-{self.window[1]} (eager) into "
                  f"{os.path.join(self.root, 'rank<k>')}", flush=True)

    def after_launch(self, rt: Any, last_iteration: int) -> None:
        if self.prof is not None:
            self.prof.step()

    def on_train_end(self, rt: Any) -> None:
        if self.prof is None:
            return
        self.stop()
        if rt.info.rank == 0:
            print(f"peerline: profile written to {os.path.join(self.root, 'rank<k>')} (one trace per rank; open "
                  "it in chrome://tracing, Perfetto or TensorBoard)", flush=True)

    def on_error(self, rt: Any, exc: BaseException) -> None:
        self.stop()

    def stop(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()


class StepRanges(IterationHooks):
    """Turns on the engine's step marks before training: NVTX ranges on a GPU, and with `labels` also
    torch.profiler labels (record_function), which show in --profile's traces on the CPU too."""

    def __init__(self, labels: bool) -> None:
        self.labels = labels
        self.open: list[Any] = []

    def on_train_start(self, rt: Any) -> None:
        nvtx = rt.device.type == "cuda"
        if nvtx or self.labels:
            rt.engine.set_ranges(*self.marks(nvtx))

    def marks(self, nvtx: bool) -> tuple[Callable[[str], None], Callable[[], None]]:
        """push(name) / pop() doing what is on."""
        labels, opened = self.labels, self.open

        def push(name: str) -> None:
            if nvtx:
                torch.cuda.nvtx.range_push(name)
            if labels:
                label = torch.autograd.profiler.record_function(name)
                label.__enter__()
                opened.append(label)

        def pop() -> None:
            if labels:
                opened.pop().__exit__(None, None, None)
            if nvtx:
                torch.cuda.nvtx.range_pop()

        return push, pop
