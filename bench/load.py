"""Load generators of the benchmarks: work a real model would add that the default model lacks.

`ScratchJitter`: forward hooks that allocate a scratch tensor of a different size for every microbatch, as a model
with variable sequence lengths would, and keep it alive for one iteration. The single suite runs the allocators
under it; a replayed CUDA graph allocates nothing, so it is meant for eager runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


class ScratchJitter:
    """Forward hooks that give every microbatch a scratch tensor of its own size, alive for one iteration.

    Models a variable sequence length: microbatch (iteration, mb) of a stage uses seq' = seq * (1 - jitter * u)
    tokens, u in [0, 1) from a fixed hash, and allocates a (micro_batch, seq', width) scratch on the stage's stream,
    writes it from the stage's output (so the allocation is really used), and holds it until the same microbatch
    of the next iteration replaces it. The stage's output is not changed: losses stay equal to a run without it.
    Iterations are counted by the hook itself: one per M forwards of a stage.
    """

    def __init__(self, jitter: float, microbatches: int, width_factor: int = 4, seed: int = 0) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"scratch jitter must be in [0, 1), got {jitter}")
        self.jitter, self.m, self.width_factor, self.seed = jitter, microbatches, width_factor, seed
        self.live: dict[tuple[int, int], torch.Tensor] = {}
        self.calls: dict[int, int] = {}
        self.sizes: list[int] = []  # elements of every scratch allocated (for tests and reports)
        self.handles: list[Any] = []

    def seq_for(self, seq: int, iteration: int, mb: int) -> int:
        """Tokens of microbatch `mb` of `iteration`: deterministic, at least 1."""
        u = (hash((self.seed, iteration, mb)) & 0xFFFF) / 0x10000
        return max(1, int(round(seq * (1.0 - self.jitter * u))))

    def install(self, modules: list[nn.Module]) -> ScratchJitter:
        """Hook every stage module (one scratch per stage and microbatch); returns self."""
        for sid, module in enumerate(modules):
            self.handles.append(module.register_forward_hook(self._hook(sid)))
        return self

    def remove(self) -> None:
        """Unhook and free the live scratch tensors."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.live.clear()

    def _hook(self, sid: int) -> Callable[[nn.Module, tuple, torch.Tensor], None]:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            n = self.calls.get(sid, 0)
            self.calls[sid] = n + 1
            iteration, mb = divmod(n, self.m)
            y = out.detach()
            batch, seq = (y.shape[0], y.shape[1]) if y.dim() >= 3 else (1, y.shape[0])
            width = y.shape[-1] * self.width_factor
            tokens = self.seq_for(seq, iteration, mb)
            scratch = torch.empty((batch, tokens, width), dtype=y.dtype, device=y.device)
            # Use it: broadcast the first tokens of the output over the scratch width.
            src = y.reshape(batch, seq, -1)[:, : min(tokens, seq)]
            scratch[:, : src.shape[1]].copy_(src.repeat(1, 1, self.width_factor)[..., :width])
            self.live[(sid, mb)] = scratch  # frees last iteration's scratch of this microbatch
            self.sizes.append(scratch.numel())

        return hook
