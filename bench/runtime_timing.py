"""Measuring a peerline Runtime inside a benchmark suite (shared by the pipeline and gpt suites): the first losses,
the wait for graph capture, timed blocks of iterations, and each rank's peak device memory.

A suite creates the runtime in the process group it already runs in and closes only the transport afterwards
(`Runtime.close` would end the process group the other measurements still use).

Each runtime runs under the main job's failsafe (watchdog, heartbeat), armed for the whole measurement: a variant
that fails on one rank or waits forever for one ends the job within the deadline (--deadline-s) with one line that
names the rank and the error, and the failure is noted in the results first (the bench's files are autosaved). The
job does not go on to the next variant: the other ranks may be stuck in device-side waits no host can release.
With `--isolate` every measurement is a job of its own (bench/isolation.py; `ISOLATED` is this job's part, from
bench/isolation_child.py), so the bench goes on after one fails. `--inject-fault ID=SPEC` (for tests) gives one
measurement's runtimes the faults SPEC (PEERLINE_FAULT's grammar; `INJECTED`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Timing, time_blocks, time_blocks_interleaved
from peerline.bench.ideal import IdealReport
from peerline.distributed.resilience.failsafe import Failsafe
from peerline.distributed.resilience.faults import Faults, parse_faults

log = logging.getLogger(__name__)


@dataclass
class Measured:
    """One measured variant: its timing, its first losses, its ideal time (when measured) and peak memory."""

    name: str
    timing: Timing
    losses: list[float]
    ideal: IdealReport | None
    peak_gb: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: max_memory_allocated of every rank, GiB, by rank (empty on the CPU)
    peak_gb_per_rank: list[float] = field(default_factory=list)

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / (self.timing.median_ms / 1e3)


@dataclass(frozen=True, slots=True)
class BlockTimer:
    """benchkit.time_blocks with a suite's counts: `iters` iterations per block, `reps` timed blocks after `warmup`.
    Defaults: --reps / --warmup, else 5 and 2 (2 and 1 with --quick); iters 5 (2 with --quick)."""

    iters: int
    reps: int
    warmup: int
    device: torch.device

    @classmethod
    def from_args(cls, args: Any, quick: bool, device: torch.device, iters: int | None = None) -> BlockTimer:
        warmup = getattr(args, "warmup", None)
        return cls(iters=iters or (2 if quick else 5), reps=getattr(args, "reps", None) or (2 if quick else 5),
                   warmup=warmup if warmup is not None else (1 if quick else 2), device=device)

    def __call__(self, run_block: Callable[[int], Any]) -> Timing:
        return time_blocks(run_block, iters=self.iters, reps=self.reps, warmup=self.warmup, device=self.device)

    def interleaved(self, run_blocks: list[Callable[[int], Any]]) -> list[Timing]:
        """Several loops' blocks taken in turn (benchkit.time_blocks_interleaved) with these counts."""
        return time_blocks_interleaved(run_blocks, iters=self.iters, reps=self.reps, warmup=self.warmup,
                                       device=self.device)


def free_device(device: torch.device) -> None:
    """Drop what the last variant left (garbage, cached blocks) and restart the peak-memory counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# (context, suite, case) of the measurement running now: what a runtime's failsafe notes if it ends the job
_current: tuple[BenchContext, str, str] | None = None
#: the watchdog's deadline on a measurement's progress, seconds (launch/bench.py --deadline-s); None: the config's
DEADLINE_S: float | None = None
#: this job's part of an isolated run (bench/isolation_child.IsolatedChild), None when the bench runs whole
ISOLATED: Any = None
#: measurement id ("pipeline quick 1f1b eager") -> PEERLINE_FAULT specification for its runtimes (--inject-fault)
INJECTED: dict[str, str] = {}


def measure_or_note(ctx: BenchContext, suite: str, case: str, measure: Callable[[], Any], failures: list[str]) -> Any:
    """One measurement on a freed device. A failure is logged and kept in `failures` for the end of the suite (the
    other measurements still run); a string back (a reason not to measure) becomes a note. Either gives None.
    The step announced is `case` alone: the bench's display prefixes the suite's name. In an isolated job only
    the measurement it takes runs; the others give their earlier result (or None), and a failure ends the job."""
    global _current
    mid = f"{suite} {case}"
    isolated = ISOLATED if ISOLATED is not None and ISOLATED.per_measurement else None
    if isolated is not None and not isolated.take(mid, ctx):
        return isolated.replay(mid)
    ctx.step(case)
    free_device(ctx.device)
    _current = (ctx, suite, case)
    try:
        got = measure()
    except Exception as exc:  # noqa: BLE001 - the other measurements still run; the suite fails at the end
        log.exception("%s %s failed", suite, case)
        failures.append(f"{case}: {type(exc).__name__}: {exc}")
        if isolated is not None:
            isolated.fail(mid, f"{type(exc).__name__}: {exc}")  # ends this job
        return None
    finally:
        _current = None  # a runtime opened outside a measurement is not noted as this one
    if isinstance(got, str):
        ctx.note(f"{suite} {case}: skipped: {got}")
    if isolated is not None:
        isolated.finish(got, ctx)
    return None if isinstance(got, str) else got


def peak_gb_per_rank(device: torch.device, others_bytes: int = 0) -> list[float]:
    """Every rank's peak allocated device memory since the last `free_device` (or peak-counter reset), less
    `others_bytes` (what another resident side holds throughout), GiB, by rank ([] on the CPU)."""
    if device.type != "cuda":
        return []
    mine = torch.tensor([(torch.cuda.max_memory_allocated(device) - others_bytes) / 2**30], dtype=torch.float64,
                        device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(mine.item())]
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(t.item()) for t in everyone]


def peak_gb(device: torch.device) -> float:
    """The largest peak over the ranks, GiB (0 on the CPU)."""
    return max(peak_gb_per_rank(device), default=0.0)


@contextlib.contextmanager
def open_runtime(cfg) -> Iterator[Any]:
    """A Runtime of `cfg` in the suite's process group; on the way out its graph (and the graph's memory pool) is
    released and its transport closed, so the next variant starts with the device's memory free."""
    from peerline.distributed.runtime import Runtime

    if DEADLINE_S is not None:
        cfg = replace(cfg, timeout_s=DEADLINE_S)
    spec = INJECTED.get(f"{_current[1]} {_current[2]}") if _current is not None else None
    faults = Faults(parse_faults(spec)) if spec else None  # None: PEERLINE_FAULT's, as in the main job
    rt = Runtime.create(cfg, hooks=[lambda rt: BenchFailsafe.attach(rt, faults=faults)])
    failsafe = rt.hooks[-1]
    failsafe.watchdog.add_last_words(_note_failure)
    try:
        yield rt
    finally:
        failsafe.close()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        rt.graphs.release()
        rt.engine.transport.close()  # not rt.close(): it would end the process group the suite still uses


def _note_failure(message: str) -> None:
    """The failsafe ends the job: the measurement running now is noted as failed (rank 0 writes the files)."""
    if _current is None:
        return
    ctx, suite, case = _current
    line = f"FAILED {suite} {case}: {message} (the job ended here)"
    if ISOLATED is not None:  # the parent notes it in the results; the line goes beside this job's log
        ISOLATED.note_failure(line)
        return
    ctx.note(line)  # rank 0: into results.md / .jsonl's notes (autosaved)
    if not ctx.is_writer:  # another rank: its own file beside them, since rank 0 may be ended before it notes
        rank = dist.get_rank() if dist.is_initialized() else 0
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        (ctx.out_dir / f"failed-rank{rank}.txt").write_text(line + "\n")


class BenchFailsafe(Failsafe):
    """The main job's failsafe (watchdog, heartbeat, fault naming) armed for a whole measurement: a suite times
    blocks of iterations with several train() calls, so the end of one does not disarm it; open_runtime closes it.
    The suite's own signal handling stays (no signal handlers of its own)."""

    @classmethod
    def attach(cls, rt: Any, **kwargs: Any) -> BenchFailsafe:
        return super().attach(rt, signals=False, **kwargs)

    def on_train_end(self, rt: Any) -> None:
        """Nothing: the end of a timed block is no end of training (and a collective here would be timed)."""


def first_losses(rt, n: int, graph: bool) -> tuple[list[float], str | None]:
    """Train `n` iterations and return their losses; with `graph`, also run the warm-up the capture waits for.
    The second item says why the iteration was not captured (None when it was, or when no graph was asked)."""
    losses = rt.train(rt.iteration + n)
    if graph and rt.graph is None:
        rt.train(rt.iteration + rt.cfg.warmup_iters + 1)
        if rt.graph is None:
            return losses, rt.graph_failed or "; ".join(rt.notices) or "no reason given"
    return losses, None


def time_runtime(rt, timer: Callable[[Callable[[int], None]], Timing]) -> Timing:
    """Time blocks of the runtime's iterations with `timer` (e.g. benchkit.time_blocks with the suite's counts)."""
    return timer(runtime_block(rt))


def runtime_block(rt) -> Callable[[int], None]:
    """The runtime's timed block: `n` iterations in one train call. From here on the loss is read once per block,
    at its end: one host sync per block, as in training."""
    rt.cfg = replace(rt.cfg, log_every=10**9)
    return lambda n: rt.train(rt.iteration + n)


def time_anchor(anchor: Any, n_losses: int, timer: Callable[[Callable[[int], None]], Timing]
                ) -> tuple[list[float], Timing]:
    """An anchor's first `n_losses` losses (each read back after its step), then timed blocks of its steps."""
    losses, block = anchor_losses_and_block(anchor, n_losses)
    return losses, timer(block)


def anchor_losses_and_block(anchor: Any, n_losses: int) -> tuple[list[float], Callable[[int], None]]:
    """An anchor's first `n_losses` losses (each read back after its step) and its timed block (`n` steps)."""
    losses = []
    for _ in range(n_losses):
        anchor.step()
        losses.append(anchor.read_loss())

    def block(n: int) -> None:
        for _ in range(n):
            anchor.step()

    return losses, block


def time_captured(rt: Any, graph: bool, n_losses: int, timer: Callable[[Callable[[int], None]], Timing]
                  ) -> tuple[list[float], Timing] | str:
    """A runtime's first `n_losses` losses, then timed blocks of its iterations; with `graph`, the reason instead
    when the iteration was not captured (a graph variant must not time eager iterations)."""
    losses, not_captured = first_losses(rt, n_losses, graph)
    if not_captured:
        return f"the iteration was not captured into a CUDA graph: {not_captured}"
    return losses, time_runtime(rt, timer)
