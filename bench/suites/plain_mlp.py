"""The residual MLP written the way a PyTorch user writes one, for the anchors of the pipeline, eager and graph
suites: nn.LayerNorm, nn.Linear with its bias, F.gelu, and nothing of peerline's model or kernels.

It is the default model's architecture (distributed/model.py's ResidualMLPBlock), so it has the same parameters
and FLOPs per token:

  x + fc2(gelu(fc1(norm(x))))      norm: nn.LayerNorm(h); fc1: nn.Linear(h, 4h) with bias; fc2: nn.Linear(4h, h);
                                   exact (erf) GELU

The difference is where fc1's bias is added: here in the GEMM's epilogue (addmm), as nn.Linear does; peerline's
block keeps it beside the GEMM for its fused bias+GELU kernel. `from_default_layers` copies the weights of the
default model's layers (fc1_bias into fc1.bias), so both start from the same weights and their losses agree to
rounding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainMLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


@torch.no_grad()
def from_default_layers(layers: nn.Sequential) -> nn.Sequential:
    """A stack of PlainMLPBlocks holding the weights of the default model's `layers` (ResidualMLPBlocks), on their
    device and in their dtype."""
    blocks = []
    for layer in layers:
        hidden = layer.norm.normalized_shape[0]
        block = PlainMLPBlock(hidden).to(layer.fc1.weight.device, layer.fc1.weight.dtype)
        block.norm.load_state_dict(layer.norm.state_dict())
        block.fc1.weight.copy_(layer.fc1.weight)
        block.fc1.bias.copy_(layer.fc1_bias)
        block.fc2.load_state_dict({"weight": layer.fc2.weight, "bias": layer.fc2.bias})
        blocks.append(block)
    return nn.Sequential(*blocks)
