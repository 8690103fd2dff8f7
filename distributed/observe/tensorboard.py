"""`--tensorboard DIR`: TensorBoard event files of every logged iteration (rank 0), through torch's SummaryWriter.

Scalars under `train/`: loss, ms_per_iter, tokens_per_s, tflops, mfu and (on a GPU) peak_mem_gb, at the
iteration's number as the step; a value that does not apply is left out. tensorboard is an optional extra
(`pip install 'peerline[tensorboard]'`); `require_tensorboard` says so in one line at start-up when it is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from peerline.distributed.config import ConfigError
from peerline.distributed.hooks import IterationHooks, IterationStats
from peerline.distributed.observe.metrics_jsonl import iteration_metrics

MISSING = ("--tensorboard needs the tensorboard package: pip install 'peerline[tensorboard]' (or pip install "
           "tensorboard)")


def require_tensorboard() -> None:
    """Raise one ConfigError line when the tensorboard package is not installed (checked without importing it)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(MISSING)


class TensorBoardWriter(IterationHooks):
    """Writes `iteration_metrics` of every logged iteration as scalars to an event file in `log_dir` (rank 0)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.writer: Any = None
        self.on_gpu = False

    def on_train_start(self, rt: Any) -> None:
        if rt.info.rank != 0:
            return
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.on_gpu = rt.device.type == "cuda"
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=10)

    def on_logged(self, rt: Any, stats: IterationStats) -> None:
        if self.writer is None:
            return
        for name, value in iteration_metrics(stats, self.on_gpu).items():
            if value is not None:
                self.writer.add_scalar(f"train/{name}", value, stats.iteration)

    def on_train_end(self, rt: Any) -> None:
        self.close()

    def on_error(self, rt: Any, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
