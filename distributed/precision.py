"""The run's precision recipe (--dtype, --precision): the dtype the parameters live in and the autocast region.

  --precision master   fp32 parameters, gradients and AdamW state; --dtype bf16 computes under bf16 autocast
                       (FusedLinear casts each weight once per iteration), --dtype fp32 computes in fp32
  --precision bf16     parameters, gradients and AdamW moments in bf16, no autocast: every layer reads and writes
                       bf16 (embedding output, residual adds, LayerNorm with fp32 statistics, stage boundaries),
                       the GEMMs read the weights as they are. torch's bf16-parameter recipe.
  --precision compact  the model as with bf16; the optimizer (grad_sync/compact_adamw.py) keeps each parameter's
                       fp32 master exactly, as the bf16 parameter plus an int16 remainder, and bf16 moments:
                       Transformer Engine's FusedAdam with store_param_remainders.

docs/PRECISION.md gives each recipe's bytes per parameter and numerics.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from peerline.distributed.config import RunConfig


def compute_dtype(cfg: RunConfig, device: torch.device) -> str:
    """bf16 by default on a GPU, fp32 on the CPU, or what --dtype says."""
    return cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")


def resolve_autocast(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the iteration: bf16 for --dtype bf16 over fp32 weights; None (no autocast) for fp32
    compute and for bf16 weights, which compute in bf16 by themselves."""
    if bf16_parameters(cfg):
        return None
    return torch.bfloat16 if compute_dtype(cfg, device) == "bf16" else None


def bf16_parameters(cfg: RunConfig) -> bool:
    """Whether the model holds bf16 parameters: --precision bf16 and compact (whose masters are the optimizer's)."""
    return cfg.precision in ("bf16", "compact")


def parameter_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if bf16_parameters(cfg) else torch.float32


def apply_precision(cfg: RunConfig, modules: list[nn.Sequential], first_stage_index: int | None) -> None:
    """Cast every floating parameter to the recipe's dtype (buffers, e.g. RoPE tables, stay fp32); with bf16
    weights, the first stage casts floating inputs (synthetic data is fp32) to bf16 on entry."""
    dtype = parameter_dtype(cfg)
    if dtype == torch.float32:
        return
    for module in modules:
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    if first_stage_index is not None:  # on the first layer: the boundary probe calls the layers one by one
        next(iter(modules[first_stage_index].children())).register_forward_pre_hook(_cast_inputs_to(dtype))


def _cast_inputs_to(dtype: torch.dtype):
    def hook(_module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return hook
