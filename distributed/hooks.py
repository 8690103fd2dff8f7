"""The extension points of the training loop: what `Runtime.train` calls, and when.

One launch runs `n` iterations (1, or K of a looped CUDA graph):

    on_train_start(rt)
    per launch:   before_launch(rt, first_iteration, n) -> the launch is issued -> after_launch(rt, last_iteration)
    per logged launch (--log-every): on_logged(rt, stats), then the caller's on_iteration(stats)
    on_train_end(rt)            or, when anything above raised,   on_error(rt, exc)  (the exception then propagates)

`on_train_start`, `before_launch` and `on_logged` run in list order; `after_launch`, `on_train_end` and `on_error`
in reverse, so hooks nest like context managers (the first hook sees an iteration first and last). Iterations are
numbered from 1: `first_iteration` is the number of the launch's first one, `last_iteration` of its last.
A hook may also name iteration cadences at which a launch must end (`launch_stops`, e.g. checkpoints), so a looped
launch never runs past them. Hooks are plain objects: they read the runtime, they never replace its methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class IterationStats:
    """What a logged launch measured: the loss after `iteration` (agreed by every rank), milliseconds and tokens per
    second per iteration, and the peak device memory so far (GiB, the largest of any rank's; 0 on the CPU).

    ppl: exp(loss) for a cross-entropy loss; tflops: achieved model TFLOP/s of the whole run (model FLOPs per token
    x tokens/s); mfu: percent of the bf16 peak of all the run's cards; peak_mem_gb_per_rank: every rank's peak, by
    rank. Each None where it does not apply (not an LM, a user model's FLOPs, an unknown card, the CPU)."""

    iteration: int
    loss: float
    ms: float
    tokens_per_s: float
    peak_mem_gb: float
    extra: dict[str, float] = field(default_factory=dict)
    ppl: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_gb_per_rank: list[float] | None = None


class IterationHooks:
    """Base class of the hooks `Runtime.train` calls; every method does nothing unless overridden. `rt` is the
    Runtime (typed loosely: this module sits below runtime.py)."""

    #: Iteration cadences (besides --log-every) at which a launch must end: a multiple of one is always the last
    #: iteration of its launch.
    launch_stops: tuple[int, ...] = ()

    def on_train_start(self, rt: Any) -> None:
        """Training is about to begin (or continue, from `rt.iteration`)."""

    def before_launch(self, rt: Any, first_iteration: int, n: int) -> None:
        """Iterations `first_iteration` .. `first_iteration + n - 1` are about to be issued in one launch."""

    def after_launch(self, rt: Any, last_iteration: int) -> None:
        """The launch ending with iteration `last_iteration` has been issued (on a GPU it may still run)."""

    def on_logged(self, rt: Any, stats: IterationStats) -> None:
        """The loss of `stats.iteration` was read back (every rank, together)."""

    def on_train_end(self, rt: Any) -> None:
        """Training reached its target iteration."""

    def on_error(self, rt: Any, exc: BaseException) -> None:
        """Training raised `exc`; it propagates after the hooks ran (a hook may end the process instead)."""


class TimelineWriter(IterationHooks):
    """At the end of training, gathers the recorded (last, eager) iteration's spans to rank 0 on one clock, draws
    them (PNG + Chrome trace) to `path_stem` and warns about any span that starts before its dependency ended."""

    def __init__(self, path_stem: str) -> None:
        self.path_stem = path_stem

    def on_train_end(self, rt: Any) -> None:
        gathered = rt.engine.timeline.gather()  # collective; None except on rank 0
        if gathered is None:
            return
        from peerline.distributed.observe.timeline_check import check_spans
        from peerline.distributed.observe.timeline_draw import write_timeline

        for path in write_timeline(gathered, self.path_stem):
            print(f"peerline: timeline written to {path}", flush=True)
        for problem in check_spans(gathered, pp=rt.mesh.pp, stages_per_rank=rt.cfg.stages)[:5]:
            log.warning("timeline: %s", problem)
