"""Shared pieces of the benchmark suites: CUDA-event timing, records, environment facts.

Every suite measures peerline and its anchor in the same run, warms up, times with CUDA events (host clock on the
CPU), repeats, and reports the median and spread. A suite module in bench/suites/ exposes

    def run(args: argparse.Namespace, ctx: BenchContext) -> None

and calls ctx.record(...) once per measurement.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peerline.distributed.observe.versions import environment_facts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timing:
    """Milliseconds per call over `reps` timed repetitions after warm-up."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    #: time_blocks only: device work still queued when the host had issued a whole block (ms, the least over ranks,
    #: median over blocks). Near 0 the device waited for the host, so the time follows the host's speed.
    host_lead_ms: float | None = None

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else float("nan")


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(samples_ms: list[float], host_leads_ms: list[float] | None = None) -> Timing:
    lead = statistics.median(host_leads_ms) if host_leads_ms else None
    return Timing(statistics.median(samples_ms), _quantile(samples_ms, 0.1), _quantile(samples_ms, 0.9),
                  len(samples_ms), lead)


def time_fn(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20,
            stream: torch.cuda.Stream | None = None, device: torch.device | None = None) -> Timing:
    """Median of `reps` timings of `fn()` after `warmup` calls (time_interleaved of one fn)."""
    return time_interleaved([fn], warmup=warmup, reps=reps, stream=stream, device=device)[0]


def time_interleaved(fns: list[Callable[[], Any]], *, warmup: int = 2, reps: int = 20,
                     stream: torch.cuda.Stream | None = None, device: torch.device | None = None,
                     before_each: Callable[[], Any] | None = None) -> list[Timing]:
    """Median of `reps` timings of each fn, the fns taken in rotation (A B C A B C ...), one Timing per fn.

    For ratios near 1 (a kernel against torch's): timing A's reps and then B's lets clock and temperature drift
    between the two blocks of time land in the ratio; in rotation every fn sees the same drift. `before_each` runs
    untimed before every timed call (on CUDA on the same stream, outside the events): e.g. an L2 scrub, so no fn
    starts with the write-backs of the one before it (in rotation A would always pay for C's dirty lines).
    On CUDA each repetition is bracketed by events recorded on `stream` (default: the current stream) and all
    events are read after one synchronize at the end, so the timed loop itself never waits on the host; on the CPU
    the host clock times each call.
    """
    on_cuda = (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available())
    for _ in range(warmup):
        for fn in fns:
            fn()
    if not on_cuda:
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(reps):
            for fn, own in zip(fns, samples):
                if before_each is not None:
                    before_each()
                t0 = time.perf_counter()
                fn()
                own.append((time.perf_counter() - t0) * 1e3)
        return [summarize(own) for own in samples]
    stream = stream or torch.cuda.current_stream()
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    for i in range(reps):
        for fn, evs in zip(fns, events):
            if before_each is not None:
                before_each()
            evs[i][0].record(stream)
            fn()
            evs[i][1].record(stream)
    torch.cuda.synchronize()
    return [summarize([s.elapsed_time(e) for s, e in evs]) for evs in events]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank(ms: float, lead_ms: float, device: torch.device, group: dist.ProcessGroup | None
                  ) -> tuple[float, float]:
    """(the maximum of `ms`, the minimum of `lead_ms`) over the ranks of `group`, in one all-reduce; the values
    themselves without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ms, lead_ms
    t = torch.tensor([ms, -lead_ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0]), -float(t[1])


def time_blocks(run: Callable[[int], Any], *, iters: int = 5, reps: int = 5, warmup: int = 1,
                device: torch.device, group: dist.ProcessGroup | None = None) -> Timing:
    """Per-iteration milliseconds of a distributed training loop: `run(n)` issues n iterations.

    Each repetition starts all ranks together (barrier + device synchronize), runs `iters` iterations without any
    host sync of ours in between (so the host may run ahead, as in training), synchronizes, and takes the slowest
    rank's time divided by `iters`. `warmup` blocks are run first and discarded. The time from the host's last
    launch to the device's end is the block's host lead (Timing.host_lead_ms).
    """
    return time_blocks_interleaved([run], iters=iters, reps=reps, warmup=warmup, device=device, group=group)[0]


def time_blocks_interleaved(runs: Sequence[Callable[[int], Any]], *, iters: int = 5, reps: int = 5, warmup: int = 1,
                            device: torch.device, group: dist.ProcessGroup | None = None) -> list[Timing]:
    """time_blocks of several loops on the same devices, their blocks taken in turn within each repetition, the
    order reversed every other one (A B, B A, ...): a drift of the host or the devices during the measurement
    (clocks, temperature, other load) falls on every loop alike instead of on whichever ran last."""
    in_group = dist.is_available() and dist.is_initialized()
    samples: list[list[float]] = [[] for _ in runs]
    leads: list[list[float]] = [[] for _ in runs]
    for rep in range(warmup + reps):
        order = range(len(runs)) if rep % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            if in_group:
                dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            runs[i](iters)
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            ms, lead = _slowest_rank((done - t0) * 1e3 / iters, (done - issued) * 1e3, device, group)
            if rep >= warmup:
                samples[i].append(ms)
                leads[i].append(lead)
    return [summarize(s, lead) for s, lead in zip(samples, leads)]


@dataclass(slots=True)
class Record:
    """One measurement: peerline's figure next to its anchor's, measured in the same run."""

    suite: str
    case: str
    metric: str  # e.g. "GB/s", "ms/iter", "tokens/s"
    peerline: float
    anchor: float
    anchor_name: str
    higher_is_better: bool = True
    sizes: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """peerline relative to the anchor, > 1 when peerline is better."""
        if self.anchor == 0 or self.peerline == 0:
            return float("nan")
        return self.peerline / self.anchor if self.higher_is_better else self.anchor / self.peerline


@dataclass
class BenchContext:
    """What a suite needs: where results go, the device, the environment facts, and whether to print."""

    out_dir: Path
    device: torch.device
    is_writer: bool = True  # rank 0 writes the files
    quick: bool = False  # tiny sizes (CI smoke test on the CPU)
    facts: dict[str, Any] = field(default_factory=environment_facts)
    records: list[Record] = field(default_factory=list)
    #: free-form lines printed under the table (ideal times, skipped variants, cross-checks)
    notes: list[str] = field(default_factory=list)
    #: called with a short description of what runs now (the progress display of launch/bench.py)
    on_step: Callable[[str], None] | None = None
    #: when set, the files are rewritten after every record and note, so a run cut short keeps what it measured
    autosave_stem: str | None = None

    def record(self, rec: Record) -> Record:
        # The host's load over the last minute, beside every figure: a host-bound measurement (eager, small
        # shapes) taken while other work ran on the machine says so in its record.
        rec.extra.setdefault("host_load_1min", round(os.getloadavg()[0], 2))
        rec.extra.setdefault("host_cores", os.cpu_count())
        self.records.append(rec)
        if self.is_writer:
            log.info("%s %s: peerline %.4g %s, %s %.4g, ratio %.3f", rec.suite, rec.case, rec.peerline, rec.metric,
                     rec.anchor_name, rec.anchor, rec.ratio)
        self._autosave()
        return rec

    def _autosave(self) -> None:
        if self.autosave_stem is not None and self.is_writer:
            self.write(self.autosave_stem)

    def note(self, text: str) -> None:
        """A line for the report (rank 0's notes are written)."""
        self.notes.append(text)
        if self.is_writer:
            log.info("%s", text)
        self._autosave()

    def step(self, what: str) -> None:
        """Announce the measurement that starts now."""
        if self.on_step is not None and self.is_writer:
            self.on_step(what)

    def write(self, stem: str = "results") -> tuple[Path, Path] | None:
        """Write all records as JSON lines plus a markdown table; returns the two paths (rank 0 only)."""
        if not self.is_writer:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        jpath, mpath = self.out_dir / f"{stem}.jsonl", self.out_dir / f"{stem}.md"
        with jpath.open("w") as f:
            for r in self.records:
                f.write(json.dumps(_finite({**asdict(r), "ratio": r.ratio, **self.facts}), allow_nan=False) + "\n")
        versions = ", ".join(f"{k} {self.facts[k]}" for k in ("torch", "cuda", "nccl", "cupy", "driver")
                             if k in self.facts)
        lines = [f"Card: {self.facts.get('card')} x {self.facts.get('world_size', 1)} rank(s); {versions}; "
                 f"date {self.facts.get('date')}"]
        if "command" in self.facts:
            lines.append(f"Command: `{self.facts['command']}`")
        lines += ["", "| suite | case | metric | peerline | anchor | anchor is | ratio |",
                 "| --- | --- | --- | ---: | ---: | --- | ---: |"]
        for r in self.records:
            lines.append(f"| {r.suite} | {r.case} | {r.metric} | {r.peerline:.4g} | {r.anchor:.4g} | "
                         f"{r.anchor_name} | {r.ratio:.3f} |")
        if self.notes:
            lines += ["", "Notes:", ""] + [f"- {n}" for n in self.notes]
        mpath.write_text("\n".join(lines) + "\n")
        return jpath, mpath


    def write_and_show(self, stem: str) -> None:
        """Write the records (rank 0) and print their markdown table: the end of a suite's own `main`."""
        paths = self.write(stem)
        if paths:
            sys.stdout.write(paths[1].read_text())


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
