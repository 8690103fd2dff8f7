"""Activation recomputation per layer (`--recompute full|N`): a stage keeps only each recomputed layer's input and
runs the layer's forward again during backward (torch.utils.checkpoint, non-reentrant).

`RecomputeSequential` is an nn.Sequential (same children, same state_dict keys, so checkpoints do not depend on
the setting) whose forward wraps its first `layers` children (all with None) in checkpoint(). Non-reentrant
checkpointing hooks into autograd's saved tensors, so the recomputation happens inside the engine's backward and
inside a captured CUDA graph alike; it restores the forward's autocast state for the recomputed forward. The RNG
state is saved and restored only for layers with dropout: saving it reads the generator, which a CUDA graph
capture refuses, and a layer without randomness recomputes the same values without it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def has_randomness(module: nn.Module) -> bool:
    """Dropout anywhere in the module (its recomputation needs the forward's RNG state)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


class RecomputeSequential(nn.Sequential):
    """nn.Sequential that recomputes the activations of its first `layers` children (None: all) in backward."""

    def __init__(self, *children: nn.Module, layers: int | None = None) -> None:
        super().__init__(*children)
        self.recompute_layers = len(self) if layers is None else min(layers, len(self))
        self._rng = [has_randomness(child) for child in self]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self):
            if i < self.recompute_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=self._rng[i])
            else:
                x = layer(x)
        return x

    def extra_repr(self) -> str:
        return f"recompute_layers={self.recompute_layers}"


def with_recompute(module: nn.Sequential, layers: int | None) -> nn.Sequential:
    """`module` with its first `layers` layers recomputed (None: all; 0: `module` itself, unchanged)."""
    if layers == 0:
        return module
    return RecomputeSequential(*module, layers=layers)
