"""Deterministic sampling of training windows from a token file.

Microbatch `global_mb` of iteration `iteration` reads `micro_batch_size` windows of seq + 1 consecutive tokens;
inputs are the first seq, labels the last seq (the next token of each input). The window offsets are a pure
function of (seed, iteration, global_mb, row) through splitmix64's finalizer (counter.py's mix64): no generator
state, nothing that depends on the NumPy version, so every rank and the single-process reference read the same
tokens for the same microbatch, in any order.
"""

from __future__ import annotations

import numpy as np
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.data.counter import GOLDEN, MASK64, mix64


class TokenSampler:
    """Windows of a 1-D token array (a TokenFile's memmap) for (seed, iteration, global microbatch)."""

    def __init__(self, tokens: np.ndarray, *, seq: int, micro_batch_size: int, seed: int) -> None:
        if seq < 1 or micro_batch_size < 1:
            raise ConfigError(f"text data: seq ({seq}) and micro batch size ({micro_batch_size}) must be positive")
        if len(tokens) < seq + 1:
            raise ConfigError(f"text data: {len(tokens)} tokens are too few for one window of seq + 1 = {seq + 1}")
        self.tokens, self.seq, self.micro_batch_size, self.seed = tokens, seq, micro_batch_size, seed
        self._span = len(tokens) - seq  # window starts 0 .. len - (seq + 1)
        self._window = np.arange(seq + 1, dtype=np.int64)

    def offsets(self, iteration: int, global_mb: int) -> np.ndarray:
        """The start of each row's window, int64 [micro_batch_size]."""
        key = mix64(mix64(mix64(self.seed) ^ (iteration & MASK64)) ^ (global_mb & MASK64))
        rows = range(1, self.micro_batch_size + 1)
        return np.array([mix64(key + row * GOLDEN) % self._span for row in rows], dtype=np.int64)

    def windows(self, iteration: int, global_mb: int) -> np.ndarray:
        """The microbatch's windows, int64 [micro_batch_size, seq + 1]."""
        index = self.offsets(iteration, global_mb)[:, None] + self._window
        return self.tokens[index].astype(np.int64)

    def batch(self, iteration: int, global_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [micro_batch_size, seq]: labels are the inputs shifted by one token."""
        windows = torch.from_numpy(self.windows(iteration, global_mb))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def fill(self, inputs: torch.Tensor, labels: torch.Tensor, iteration: int, global_mb: int) -> None:
        """Write the microbatch into existing int64 [micro_batch_size, seq] tensors (pinned staging buffers or a
        graph's static inputs keep their addresses)."""
        windows = torch.from_numpy(self.windows(iteration, global_mb))
        inputs.copy_(windows[:, :-1])
        labels.copy_(windows[:, 1:])
