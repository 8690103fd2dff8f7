"""Launch plans and the peerline-or-torch choice per card, read from kernels/card_plans.json.

H100 and H200 are both sm_90 but differ in memory bandwidth and L2, so a plan tuned on one can lose to torch on the
other. The tuning command (python -m peerline.bench.kernel_tools.tune) times candidate plans and torch's op on the
card it runs on and writes that card's entry, keyed by its device name ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):

    {"NVIDIA H200": {
        "plans": "residual_add:bf16=w4.s4.t128.d1.l1.h1.r1,...",      plan.parse_op_plans syntax
        "choice": {"residual_add:bf16": [[16777216, "torch"], [268435456, "peerline"]], ...},
        "eager_torch_below": {"residual_add": 67108864, ...},
        "host_us": {...}, "tuned": {...}}}                                what was measured (not read)

`choice` lists (bytes moved, winner) at the sizes timed on the device (each op captured in a CUDA graph, replays in
rotation with torch's): a launch takes the verdict of the largest timed size at or below its bytes (the smallest
timed size's below them all). `eager_torch_below` is where eager launches turn to torch's op: below that many bytes
the kernel's device-time lead is smaller than its extra host time per launch (both measured by the tuner). Pure
Python (no CUDA), so the CPU tests check lookups and rules with a mocked device name.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerline.files import atomic_write

log = logging.getLogger(__name__)

TABLE_FILE = Path(__file__).resolve().parent / "card_plans.json"
# Eager launches below this many bytes moved use torch's op on a card without a measured entry: there a peerline
# launch's extra host time (an autograd Function and a driver call from Python) outweighs its device-time lead.
DEFAULT_EAGER_TORCH_BELOW = 64 << 20
# An eager threshold at or above this never sends a launch to the kernel (the tuner writes 1 << 62 where torch's op
# wins an eager launch at every size).
NEVER_EAGER = 1 << 62
PEERLINE = "peerline"  # a verdict: peerline's kernel is faster here
TORCH = "torch"  # a verdict: torch's op is faster here


@dataclass(frozen=True)
class CardTable:
    """One card's entry: plans (plan.parse_op_plans text), per-op size verdicts and eager thresholds."""

    card: str
    plans: str = ""
    choice: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    eager_torch_below: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_entry(cls, card: str, entry: dict[str, Any]) -> CardTable:
        choice = {}
        for key, points in (entry.get("choice") or {}).items():
            pts = tuple(sorted((int(b), str(w)) for b, w in points))
            if any(w not in (PEERLINE, TORCH) for _, w in pts):
                raise ValueError(f"card table {card!r}: {key} names a winner other than {PEERLINE} / {TORCH}")
            choice[key] = pts
        below = {str(k): int(v) for k, v in (entry.get("eager_torch_below") or {}).items()}
        return cls(card, str(entry.get("plans") or ""), choice, below)

    def device_winner(self, key: str, nbytes: int) -> str:
        """peerline or torch for a launch of op:dtype `key` moving `nbytes`, by device time (PEERLINE when the key
        was never timed)."""
        points = self.choice.get(key)
        if not points:
            return PEERLINE
        i = bisect.bisect_right([b for b, _ in points], nbytes) - 1
        return points[max(i, 0)][1]

    def eager_threshold(self, op: str) -> int:
        return self.eager_torch_below.get(op, DEFAULT_EAGER_TORCH_BELOW)

    def eager_always_torch(self, op: str, dtype: str) -> bool:
        """Whether every eager launch of `op` on `dtype` runs torch's op and no captured launch of any size would run
        the kernel either (so an eager call needs no size lookup and no kernel built ahead of a capture)."""
        points = self.choice.get(f"{op}:{dtype}")
        return self.eager_threshold(op) >= NEVER_EAGER and bool(points) and all(w == TORCH for _, w in points)

    def pick(self, op: str, dtype: str, nbytes: int, eager: bool) -> str:
        """The implementation of one launch: torch where it is faster on this card at this size, and for eager
        launches below the op's threshold; else peerline."""
        if eager and nbytes < self.eager_threshold(op):
            return TORCH
        return self.device_winner(f"{op}:{dtype}", nbytes)


def read_tables(path: Path = TABLE_FILE) -> dict[str, dict[str, Any]]:
    """Every card's raw entry ({} when the file is missing)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of card name -> entry")
    return data


def table_for(card: str, path: Path = TABLE_FILE) -> CardTable:
    """The entry of the card named `card` (exact device name), else an empty table (builtin plans, default
    threshold); a broken file is logged once per lookup and treated as empty."""
    try:
        entry = read_tables(path).get(card)
    except (OSError, ValueError) as exc:
        log.warning("kernel card table %s unreadable (%s); using the builtin plans", path, exc)
        entry = None
    if entry is None:
        return CardTable(card)
    return CardTable.from_entry(card, entry)


def write_entry(card: str, entry: dict[str, Any], path: Path = TABLE_FILE) -> None:
    """Replace `card`'s entry in the table file, keeping the other cards' (checked by CardTable before writing)."""
    CardTable.from_entry(card, entry)
    tables = read_tables(path)
    tables[card] = entry
    data = (json.dumps(tables, indent=1, sort_keys=True) + "\n").encode()
    atomic_write(path, lambda f: f.write(data))
