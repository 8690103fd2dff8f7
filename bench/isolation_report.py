"""The results of an isolated bench run (bench/isolation.py), merged from its jobs into the usual files.

Each job's result.json (bench/isolation_child.py) holds the records and notes its suite produced: records of the
measurement it took, and the suite's aggregate records (ratios against the anchor, `best`) from every result known
so far. Records merge by (suite, case), a later job's replacing an earlier one's (it knew more results). Notes are
those written while each job's own measurement ran, then the notes of the suite's last complete run (which saw
every result), each line once. The files are benchkit's (BenchContext.write: results.jsonl and results.md), plus
measurements.jsonl: one line per measurement (or whole suite) with its status, error line, seconds and job folder.
They are rewritten after every job, so a bench cut short keeps what it measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peerline.bench.benchkit import BenchContext, Record

_RECORD_FIELDS = ("suite", "case", "metric", "peerline", "anchor", "anchor_name", "higher_is_better", "sizes",
                  "extra")


def _record(d: dict[str, Any]) -> Record:
    fields = {k: d[k] for k in _RECORD_FIELDS if k in d}
    for k in ("peerline", "anchor"):  # written as null when not finite
        fields[k] = math.nan if fields.get(k) is None else fields[k]
    return Record(**fields)


@dataclass
class MergedResults:
    """Records, notes and per-measurement outcomes of an isolated run; `write` produces the files."""

    out_dir: Path
    facts: dict[str, Any] = field(default_factory=dict)
    records: dict[tuple[str, str], Record] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    def add_job(self, result: dict[str, Any] | None) -> None:
        """A finished job's records (later ones replace earlier ones of the same case) and its own notes."""
        if result is None:
            return
        for d in result.get("records", []):
            rec = _record(d)
            self.records[(rec.suite, rec.case)] = rec
        self.note_all(result.get("window_notes", []))
        self.facts.update({k: v for k, v in result.get("facts", {}).items() if k != "command"})

    def add_final(self, result: dict[str, Any]) -> None:
        """The suite's last complete run: its records and every note it wrote."""
        self.add_job(result)
        self.note_all(result.get("notes", []))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def note_all(self, texts: list[str]) -> None:
        for text in texts:
            self.note(text)

    def outcome(self, suite: str, mid: str | None, status: str, error: str, seconds: float, folder: Path) -> None:
        """One line of measurements.jsonl: a measurement's (or a whole suite's, `mid` None) status and error."""
        self.outcomes.append({"suite": suite, "id": mid, "status": status, "error": error or None,
                              "seconds": round(seconds, 3), "job": str(folder)})

    def write(self, stem: str) -> tuple[Path, Path] | None:
        """results.jsonl / results.md (benchkit's writer) and measurements.jsonl; the first two paths."""
        ctx = BenchContext(out_dir=self.out_dir, device=torch.device("cpu"), facts=dict(self.facts),
                           records=list(self.records.values()), notes=list(self.notes))
        paths = ctx.write(stem)
        with (self.out_dir / "measurements.jsonl").open("w") as f:
            for line in self.outcomes:
                f.write(json.dumps(line) + "\n")
        return paths
