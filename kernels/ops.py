"""The elementwise ops of the default block, with one switch between implementations.

`impl="torch"` is the reference (and the only implementation on the CPU); `impl="peerline"` uses the
warp-specialized CUDA kernels of this package; `impl="auto"` (what --kernels auto resolves to on a GPU with CuPy)
picks per launch: the kernel where the card's table (kernels/card_plans.json, card_table.py) says it beats torch's op
on this card at this size, torch's op elsewhere and for small eager launches (host-bound). All have the same
semantics:

  bias_gelu(x, b)     = gelu(x + b)            exact (erf) GELU, b broadcast over the last dimension
  residual_add(x, y)  = x + y                  result in torch.result_type(x, y)
  linear_bias_gelu(l, x, b) = gelu(l(x) + b)   for a Linear without its own bias; "auto", eager, where torch's ops
                                               run bias+GELU: the bias in the GEMM's epilogue
  linear(x, w, b)     = F.linear(x, w, b)      under the caller's autocast; "peerline" accumulates dW straight
                                               into the fp32 w.grad (fused_linear.linear), also on the CPU
  pre_norm_mlp(x, norm, fc1, b, fc2, impl) = x + fc2(gelu(fc1(norm(x)) + b)), with the norm's residual backward
                                               (the residual-MLP block, the GPT block's MLP half)
  mlp_block_on_torch(x, fc1, b, fc2)           "auto", eager: whether every op of the residual-MLP block runs
                                               torch's, so the block may call them directly (distributed/model.py)

Layering: reference.py (torch) <- elementwise.py (CUDA kernels), fused_linear.py (dW fusion) <- this module. The
elementwise module is imported on first use and kept (`_elementwise`): its first use compiles with CuPy/NVRTC.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from peerline.choices import KERNEL_IMPLEMENTATIONS as IMPLEMENTATIONS
from peerline.choices import KERNELS
from peerline.kernels.capture_state import capturing
from peerline.kernels.fused_linear import FusedLinear, compute_dtype, eager_plain, linear
from peerline.kernels.layer_norm import FusedLayerNorm
from peerline.kernels.reference import bias_gelu_reference, residual_add_reference

__all__ = ["IMPLEMENTATIONS", "bias_gelu", "bias_gelu_reference", "linear", "linear_bias_gelu", "mlp_block_on_torch",
           "pre_norm_mlp", "residual_add", "residual_add_reference", "resolve_impl"]

log = logging.getLogger(__name__)


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' -> 'auto' on CUDA (the per-launch choice; torch if CuPy, which compiles the kernels, is not
    installed), torch elsewhere; the CPU always uses torch. An explicit 'peerline' without CuPy fails at the first
    launch."""
    if impl not in KERNELS:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of auto, {', '.join(IMPLEMENTATIONS)}")
    if device.type != "cuda":
        return "torch"
    if impl == "auto":
        if importlib.util.find_spec("cupy") is None:
            log.info("kernels=auto: CuPy is not installed, using the torch reference kernels")  # main job: notice
            return "torch"
        return "auto"
    return impl


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """gelu(x + bias) by `impl` (the peerline kernels only for CUDA tensors)."""
    if impl != "torch" and x.is_cuda:
        ew = _elementwise()
        return ew.bias_gelu(x, bias) if impl == "peerline" else ew.auto_bias_gelu(x, bias)
    return bias_gelu_reference(x, bias)


def linear_bias_gelu(linear: FusedLinear, x: torch.Tensor, bias: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """gelu(linear(x) + bias) for a Linear without a bias of its own. Where `impl` is "auto", the launch is eager on
    a GPU and bias+GELU would run torch's ops at this size (elementwise.eager_bias_gelu_on_torch), the bias goes into
    the GEMM's epilogue instead (F.linear with it, as nn.Linear does: one launch and one autograd node fewer, for a
    host-bound run); elsewhere bias_gelu of linear's output."""
    if impl == "auto" and x.is_cuda and not capturing():
        dtype = compute_dtype(x, linear.weight)
        if bias.dtype == dtype or torch.is_autocast_enabled(x.device.type):  # (autocast casts the bias)
            width = linear.out_features
            if _elementwise().eager_bias_gelu_on_torch(dtype, bias.dtype, x.numel() // x.shape[-1] * width, width,
                                                    x.get_device()):
                return F.gelu(linear.with_bias(x, bias))
    return bias_gelu(linear(x), bias, impl)


def pre_norm_mlp(x: torch.Tensor, norm: FusedLayerNorm, fc1: FusedLinear, fc1_bias: torch.Tensor, fc2: FusedLinear,
                 impl: str = "torch") -> torch.Tensor:
    """x + fc2(gelu(fc1(norm(x)) + fc1_bias)). Where the norm's kernels run, its backward also adds the residual's
    gradient into x's and sums fc2's bias gradient (FusedLayerNorm.with_residual); fc2 then runs with its bias
    outside autograd, so that gradient is counted once."""
    n, residual, fc2_bias_done = norm.with_residual(x, fc2.bias)
    h = linear_bias_gelu(fc1, n, fc1_bias, impl)
    out = fc2.forward_bias_grad_elsewhere(h) if fc2_bias_done else fc2(h)
    return residual_add(residual, out, impl)


def mlp_block_on_torch(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
                       fc2_weight: torch.Tensor) -> bool:
    """--kernels auto, an eager forward of x on a GPU: whether every op of the residual-MLP block
    x + fc2(gelu(fc1(norm(x)) + b1)) would run torch's own op: both Linears plain F.linear
    (fused_linear.eager_plain), fc1's bias in its GEMM's epilogue with torch's GELU (linear_bias_gelu's eager rule)
    and torch's add. Then the block calls those ops itself, with no choice per op: the same kernels and results for
    less host time. Cached per dtype, size, autocast state and weight dtypes."""
    autocast = torch.is_autocast_enabled("cuda")
    dev = x.get_device()
    width = fc1_weight.shape[0]
    key = ("mlp block on torch", x.dtype, x.numel(), x.shape[-1], dev, autocast,
           torch.get_autocast_dtype("cuda") if autocast else None, fc1_weight.dtype, fc1_bias.dtype, fc2_weight.dtype,
           width)
    ew = _elementwise()
    hit = ew._CHOICES.get(key)
    if hit is None:
        dtype = compute_dtype(x, fc1_weight)
        rows = x.numel() // x.shape[-1]
        hit = (eager_plain(x, fc1_weight) and eager_plain(x, fc2_weight)
               and (fc1_bias.dtype == dtype or autocast)
               and ew.eager_bias_gelu_on_torch(dtype, fc1_bias.dtype, rows * width, width, dev)
               and ew.eager_residual_add_on_torch(x.dtype, dtype, x.numel(), dev))
        ew._remember(ew._CHOICES, key, hit)
    return hit


_elementwise_module = None


def _elementwise():
    """kernels.elementwise, imported on first use (it needs CuPy) and kept: an import statement per call costs more
    host time than the lookup it serves."""
    global _elementwise_module
    if _elementwise_module is None:
        from peerline.kernels import elementwise

        _elementwise_module = elementwise
    return _elementwise_module


def residual_add(x: torch.Tensor, y: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """x + y by `impl` (the peerline kernels only for CUDA tensors)."""
    if impl != "torch" and x.is_cuda:
        ew = _elementwise()
        return ew.residual_add(x, y) if impl == "peerline" else ew.auto_residual_add(x, y)
    return residual_add_reference(x, y)

