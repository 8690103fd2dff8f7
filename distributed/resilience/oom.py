"""Out of device memory as one line: which rank and stage, what it was allocating, every rank's peak, what helps.

  rank 1 (stage 1) ran out of GPU memory during iteration 3 (act mb 2 from rank 0 ...): tried to allocate
  2.00 GiB with 78.6 GiB of 79.2 GiB in use; peak memory by rank: 0: 41.2 GiB, 1: 78.9 GiB; to use less:
  --micro-batch-size 1 (now 4), --recompute full, more pipeline stages (--pp, or more ranks), --dtype bf16

torch's own message (several lines: the allocator's figures, a hint about expandable segments) is reduced to the
size of the allocation and the device's use. The peaks of the other ranks come from their beats (heartbeat.py).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from peerline.distributed.resilience.watchdog import run_bounded

_TRIED = re.compile(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)")
_TOTAL = re.compile(r"total capacity of ([0-9.]+ [KMGT]?i?B)")


def is_oom(exc: BaseException) -> bool:
    """torch's out-of-memory error (CUDA's, or the caching allocator's) or a CPU allocator's refusal."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def oom_line(exc: BaseException, who: str, during: str, peaks: dict[int, float], cfg: Any) -> str:
    """The one line (without 'peerline: error: ') for an out-of-memory `exc` on rank `who`."""
    text = str(exc)
    tried = _TRIED.search(text)
    total = _TOTAL.search(text)
    what = f"tried to allocate {tried.group(1)}" if tried else "an allocation failed"
    if total:
        what += f" on a device of {total.group(1)}"
    device = "GPU" if "CUDA" in text or "GPU" in text else "device"
    peak = ", ".join(f"{r}: {gib:.1f} GiB" for r, gib in sorted(peaks.items())) if peaks else "not known"
    return (f"{who} ran out of {device} memory during {during}: {what}; peak memory by rank: {peak}; to use less: "
            f"{', '.join(remedies(cfg))}")


def remedies(cfg: Any) -> list[str]:
    """The flags that lower a rank's memory, from what this run set."""
    tips = []
    if cfg.micro_batch_size > 1:
        tips.append(f"--micro-batch-size {max(1, cfg.micro_batch_size // 2)} (now {cfg.micro_batch_size})")
    if cfg.recompute != "full":
        tips.append(f"--recompute full (now {cfg.recompute})")
    if cfg.schedule != "1f1b":
        tips.append(f"--schedule 1f1b (now {cfg.schedule}: every microbatch's activations in flight)")
    tips.append("more pipeline stages (--pp, or more ranks)")
    if cfg.dtype == "fp32":
        tips.append("--dtype bf16")
    return tips


def peaks_by_rank(watchdog: Any, rank: int, device: torch.device) -> dict[int, float]:
    """Every rank's peak device memory, GiB: the others' from their last beats (bounded), this rank's now."""
    peaks: dict[int, float] = {}
    if watchdog.heartbeat is not None:
        peaks.update(run_bounded(watchdog.heartbeat.peaks, 3.0, fallback={}))
    if device.type == "cuda":
        peaks[rank] = torch.cuda.max_memory_allocated(device) / 2**30
    return peaks
