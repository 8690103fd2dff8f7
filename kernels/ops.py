"""The elementwise ops of the default block, with one switch between implementations.

`impl="torch"` is the reference (and the only implementation on the CPU); `impl="peerline"` uses the
warp-specialized CUDA kernels of this package. Both have the same semantics:

  bias_gelu(x, b)     = gelu(x + b)            exact (erf) GELU, b broadcast over the last dimension
  residual_add(x, y)  = x + y                  result in torch.result_type(x, y)
  linear(x, w, b)     = F.linear(x, w, b)      under the caller's autocast; "peerline" accumulates dW straight
                                               into the fp32 w.grad (fused_linear.py), also on the CPU

GPU-only modules (CuPy, NVRTC) are imported lazily, inside the peerline branch.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("peerline", "torch")
log = logging.getLogger(__name__)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias.to(x.dtype))


def residual_add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' -> peerline on CUDA (torch if CuPy, which compiles the kernels, is not installed), torch
    elsewhere; the CPU always uses torch. An explicit 'peerline' without CuPy fails at the first launch."""
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of auto, {', '.join(IMPLEMENTATIONS)}")
    if device.type != "cuda":
        return "torch"
    if impl == "auto":
        if importlib.util.find_spec("cupy") is None:
            log.warning("kernels=auto: CuPy is not installed, using the torch reference kernels")
            return "torch"
        return "peerline"
    return impl


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    if impl == "peerline" and x.is_cuda:
        from peerline.kernels import elementwise  # lazy: needs CuPy

        return elementwise.bias_gelu(x, bias)
    return bias_gelu_reference(x, bias)


def residual_add(x: torch.Tensor, y: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    if impl == "peerline" and x.is_cuda:
        from peerline.kernels import elementwise  # lazy: needs CuPy

        return elementwise.residual_add(x, y)
    return residual_add_reference(x, y)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, impl: str = "torch",
           cache: object | None = None) -> torch.Tensor:
    """F.linear; with impl="peerline" (and a weight that will get a gradient) the weight's gradient is accumulated
    in place into weight.grad by fused_linear.linear_accumulate, and its low-precision copy comes from `cache`
    (a fused_linear.CastCache) once per iteration."""
    if impl == "peerline" and weight.requires_grad and torch.is_grad_enabled():
        from peerline.kernels import fused_linear

        if cache is None:
            cache = fused_linear.CastCache()  # no reuse across microbatches: the caller should keep one
        return fused_linear.linear_accumulate(x, weight, bias, cache)
    return F.linear(x, weight, bias)
