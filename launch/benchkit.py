"""Shared pieces of the benchmark suites: CUDA-event timing, records, environment facts.

Every suite measures peerline and its anchor in the same run, warms up, times with CUDA events (host clock on the
CPU), repeats, and reports the median and spread. A suite module in launch/suites/ exposes

    def run(args: argparse.Namespace, ctx: BenchContext) -> None

and calls ctx.record(...) once per measurement.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Timing:
    """Milliseconds per call over `reps` timed repetitions after warm-up."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else float("nan")


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(samples_ms: list[float]) -> Timing:
    return Timing(statistics.median(samples_ms), _quantile(samples_ms, 0.1), _quantile(samples_ms, 0.9),
                  len(samples_ms))


def time_fn(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20,
            stream: torch.cuda.Stream | None = None, device: torch.device | None = None) -> Timing:
    """Median of `reps` timings of `fn()` after `warmup` calls.

    On CUDA each repetition is bracketed by events recorded on `stream` (default: the current stream) and all
    events are read after one synchronize at the end, so the timed loop itself never waits on the host.
    """
    on_cuda = (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available())
    for _ in range(warmup):
        fn()
    if not on_cuda:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return summarize(samples)
    stream = stream or torch.cuda.current_stream()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record(stream)
        fn()
        ends[i].record(stream)
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])


def environment_facts() -> dict[str, Any]:
    """Card, driver and library versions that every record carries."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "card": "cpu",
    }
    if torch.cuda.is_available():
        facts["card"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
        facts["gpus"] = torch.cuda.device_count()
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - an optional fact
            pass
        try:
            import cupy

            facts["cupy"] = cupy.__version__
            facts["driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception:  # noqa: BLE001 - CuPy is optional
            pass
    return facts


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

    def record(self, rec: Record) -> Record:
        self.records.append(rec)
        return rec

    def write(self, stem: str = "results") -> tuple[Path, Path] | None:
        """Write all records as JSON lines plus a markdown table; returns the two paths (rank 0 only)."""
        if not self.is_writer:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        jpath, mpath = self.out_dir / f"{stem}.jsonl", self.out_dir / f"{stem}.md"
        with jpath.open("w") as f:
            for r in self.records:
                f.write(json.dumps({**asdict(r), "ratio": r.ratio, **self.facts}) + "\n")
        lines = [f"Card: {self.facts.get('card')}, torch {self.facts.get('torch')}, date {self.facts.get('date')}",
                 "", "| suite | case | metric | peerline | anchor | anchor is | ratio |",
                 "| --- | --- | --- | ---: | ---: | --- | ---: |"]
        for r in self.records:
            lines.append(f"| {r.suite} | {r.case} | {r.metric} | {r.peerline:.4g} | {r.anchor:.4g} | "
                         f"{r.anchor_name} | {r.ratio:.3f} |")
        mpath.write_text("\n".join(lines) + "\n")
        return jpath, mpath
