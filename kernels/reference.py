"""The torch reference of each elementwise op: the semantics every implementation matches, and the CPU's path.

Pure torch (no CuPy), so every other kernels module may import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias), exact (erf) GELU, bias cast to x's dtype and broadcast over the last dimension."""
    # A bias already in x's dtype is used as it is (what .to gives back then), without the call per microbatch.
    return F.gelu(x + (bias if bias.dtype == x.dtype else bias.to(x.dtype)))


def residual_add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y in torch.result_type(x, y)."""
    return x + y
