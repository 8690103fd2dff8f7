"""`--metrics-jsonl PATH`: one JSON object per logged iteration, a line each, flushed as it is written (rank 0).

    {"iteration": 5, "loss": 2.06, "ms_per_iter": 890.3, "tokens_per_s": 575.1, "tflops": 0.0036, "mfu": null,
     "peak_mem_gb": null, "time": 1764166322.1}

A value that does not apply (MFU of an unknown card, memory on the CPU) or is not finite is null, so every line is
strict JSON. A fresh run writes the file anew; a resumed run (--resume) appends to it.
"""

from __future__ import annotations

import json
import math
import time
from typing import IO, Any

from peerline.distributed.hooks import IterationHooks, IterationStats


def iteration_metrics(stats: IterationStats, on_gpu: bool) -> dict[str, float | None]:
    """The metrics of one logged iteration by name (shared with the TensorBoard writer); peak memory is None on
    the CPU, where it is not measured."""
    values = {"loss": stats.loss, "ms_per_iter": stats.ms, "tokens_per_s": stats.tokens_per_s,
              "tflops": stats.tflops, "mfu": stats.mfu, "peak_mem_gb": stats.peak_mem_gb if on_gpu else None}
    return {k: (v if v is not None and math.isfinite(v) else None) for k, v in values.items()}


class MetricsJsonl(IterationHooks):
    """Writes `iteration_metrics` of every logged iteration to `path` on rank 0 (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: IO[str] | None = None
        self.on_gpu = False

    def on_train_start(self, rt: Any) -> None:
        if rt.info.rank != 0:
            return
        self.on_gpu = rt.device.type == "cuda"
        self.file = open(self.path, "a" if rt.cfg.resume else "w", encoding="utf-8")  # noqa: SIM115 - closed at the end

    def on_logged(self, rt: Any, stats: IterationStats) -> None:
        if self.file is None:
            return
        record = {"iteration": stats.iteration, **iteration_metrics(stats, self.on_gpu), "time": time.time()}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def on_train_end(self, rt: Any) -> None:
        self.close()

    def on_error(self, rt: Any, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
