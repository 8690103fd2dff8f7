"""User models for the failure tests (`--model failures_models:<factory>`, with this folder on PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn


class GrowsAfter(nn.Module):
    """A Linear whose output gains a column after `limit` forward calls: a stage output that changes shape
    between microbatches, in the middle of training."""

    def __init__(self, h: int, limit: int) -> None:
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.limit = limit
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return torch.cat([y, y[..., :1]], dim=-1) if self.calls > self.limit else y


def shape_changer() -> nn.Sequential:
    """Four equal layers, split 2 + 2 for pp=2: stage 0's output changes shape at its 7th forward call (one probe
    call, four microbatches of iteration 1, then microbatch 1 of iteration 2)."""
    return nn.Sequential(nn.Linear(32, 32), GrowsAfter(32, limit=6), nn.Linear(32, 32), nn.Linear(32, 32))


class Sleep(nn.Module):
    """The identity after `seconds` of sleep: a step whose host time, not its handoffs, makes the iteration long."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return x


def slow_steps() -> nn.Sequential:
    """Four layers split 2 + 2 for pp=2; stage 0's forward sleeps 10 ms per microbatch, so M=300 makes an
    iteration last over 3 s on any machine while a handoff completes every few milliseconds."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), Sleep(0.01), nn.Linear(32, 32), nn.Linear(32, 32))
