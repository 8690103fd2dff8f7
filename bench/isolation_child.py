"""One isolated job of `launch/bench.py --isolate` (bench/isolation.py starts it): the suite runs as usual, but
only one of its measurements is measured here; the others are replayed from what earlier jobs measured.

The parent writes `ledger.json` into the job's folder (`--isolated-child DIR`): the suite, the mode ("measure":
one measurement per job; "whole": the suite runs whole, as one job) and, for "measure", the measurements already
done and the results of those that succeeded. `runtime_timing.measure_or_note` asks `take(id)` for each
measurement the suite reaches, in the suite's own order: the first one not done yet is measured (its id written to
`started.json` first, so the parent can name it whatever happens next); every other one is replayed with `replay`
(its earlier result, or None). The suite then records its aggregate lines (ratios against the anchor, `best`)
from real and replayed results alike. A measurement that raises on a rank ends this job at once with one line
naming the rank and the error (`fail`); the other ranks may be waiting for that rank where no host can release
them, and torchrun ends them as soon as one rank exits. At the end rank 0 writes `result.json`: the measurement
taken and its result, every measurement the suite reached, the records and notes of this job, the environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from peerline import torchrun_report
from peerline.bench.benchkit import BenchContext, Timing
from peerline.bench.ideal import IdealReport
from peerline.bench.runtime_timing import Measured

log = logging.getLogger(__name__)

LEDGER, STARTED, RESULT = "ledger.json", "started.json", "result.json"
#: the exit code of a job whose measurement raised (the parent reads the error line, not the code)
EXIT_FAILED = 1


def measured_to_dict(m: Measured) -> dict[str, Any]:
    """A Measured as JSON-able data (measured_from_dict reads it back)."""
    d = asdict(m)
    d["ideal"] = None if m.ideal is None else asdict(m.ideal)
    return d


def measured_from_dict(d: dict[str, Any]) -> Measured:
    ideal = d.get("ideal")
    if ideal is not None:
        ideal = IdealReport(ideal["schedule"], ideal["microbatches"], tuple(ideal["fwd_ms"]), tuple(ideal["bwd_ms"]),
                            ideal["achieved_ms"])
    return Measured(d["name"], Timing(**d["timing"]), list(d["losses"]), ideal, d["peak_gb"], dict(d["extra"]),
                    list(d.get("peak_gb_per_rank", [])))


@dataclass
class IsolatedChild:
    """This job's part of an isolated run: which measurement it takes, what it replays, what it reports."""

    folder: Path
    rank: int
    suite: str
    mode: str  # "measure" or "whole"
    done: set[str] = field(default_factory=set)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    picked: str | None = None
    status: str | None = None  # "ok", "skipped: <why>"
    result: dict[str, Any] | None = None
    window_notes: list[str] = field(default_factory=list)
    _notes_at: int = 0

    @classmethod
    def load(cls, folder: Path, rank: int) -> IsolatedChild:
        """The job of `folder`'s ledger."""
        ledger = json.loads((folder / LEDGER).read_text())
        return cls(folder, rank, ledger["suite"], ledger["mode"], set(ledger.get("done", [])),
                   dict(ledger.get("measured", {})))

    @property
    def per_measurement(self) -> bool:
        return self.mode == "measure"

    def take(self, mid: str, ctx: BenchContext) -> bool:
        """True when this job measures `mid` (the first measurement not done yet); its id is written first."""
        self.seen.append(mid)
        if self.picked is not None or mid in self.done:
            return False
        self.picked, self._notes_at = mid, len(ctx.notes)
        if self.rank == 0:
            _write_json(self.folder / STARTED, {"id": mid})
        return True

    def replay(self, mid: str) -> Measured | None:
        """An earlier job's result of `mid`, or None (failed, skipped, or not measured yet)."""
        got = self.measured.get(mid)
        return None if got is None else measured_from_dict(got)

    def finish(self, got: Any, ctx: BenchContext) -> None:
        """The measurement taken is over: its result (a Measured) or why it was skipped (a string)."""
        self.window_notes = list(ctx.notes[self._notes_at:])
        if isinstance(got, Measured):
            self.status, self.result = "ok", measured_to_dict(got)
        else:
            self.status = f"skipped: {got}" if isinstance(got, str) else "no result"

    def fail(self, mid: str, message: str) -> None:
        """The measurement taken raised on this rank: one line naming the rank and the error, then this process
        ends (the others may wait for it in device-side waits; torchrun ends them once this one is gone)."""
        line = f"peerline: error: rank {self.rank}: {mid} failed: {message}"
        try:
            (self.folder / f"failed-rank{self.rank}.txt").write_text(line + "\n")
        except OSError:
            pass
        torchrun_report.write_error_file(line, EXIT_FAILED)
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(EXIT_FAILED)

    def note_failure(self, line: str) -> None:
        """A runtime's failsafe ends this job (watchdog): the line, beside the job's log, from every rank."""
        try:
            (self.folder / f"failed-rank{self.rank}.txt").write_text(line + "\n")
        except OSError:
            pass

    def write_result(self, ctx: BenchContext, outcome: str) -> None:
        """result.json (rank 0): what this job measured and reached, its records, notes and environment."""
        if self.rank != 0:
            return
        _write_json(self.folder / RESULT, {
            "suite": self.suite, "picked": self.picked, "status": self.status, "measured": self.result,
            "seen": self.seen, "outcome": outcome, "records": [asdict(r) for r in ctx.records],
            "notes": list(ctx.notes), "window_notes": self.window_notes, "facts": ctx.facts})


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)
