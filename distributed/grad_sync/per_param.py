"""The plain data-parallel gradient average: one all-reduce per parameter after the last backward.

This is the reference that bucketed all-reduce (buckets.py) is checked against, and the fallback when buckets
are switched off. It has the engine's gradient-sync interface: zero_grad / arm / finish / metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def ensure_grads(params: list[nn.Parameter]) -> None:
    """Give every parameter a zero .grad, so the first backward accumulates in place like every later one
    (a CUDA graph needs the grads' addresses fixed before capture)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def average_op(group: dist.ProcessGroup | None) -> tuple[dist.ReduceOp, float]:
    """AVG where the backend has it (NCCL); gloo has no AVG, so SUM then scale."""
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, 1.0
    return dist.ReduceOp.SUM, 1.0 / size


class PerParameterAllReduce:
    """All-reduce every gradient separately over the dp group after the last microbatch's backward."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, dp: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp = dp
        ensure_grads(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad.zero_()

    def arm(self) -> None:
        """Nothing to start early: this sync works after the whole backward."""

    def finish(self) -> None:
        if self.dp == 1:
            return
        op, scale = average_op(self.group)
        for p in self.params:
            dist.all_reduce(p.grad, op=op, group=self.group)
            if scale != 1.0:
                p.grad.mul_(scale)

    def metrics(self) -> dict[str, float]:
        return {}
