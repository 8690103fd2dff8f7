"""The run's precision recipe (--dtype, --precision): the dtype the parameters live in and the autocast region.

  --precision master    with bf16 compute (--dtype bf16, the GPU default): the model of the bf16 recipe (bf16
                        parameters read by the GEMMs as they are, bf16 gradients, no autocast); the optimizer
                        (grad_sync/master_adamw.py) keeps fp32 master weights and fp32 AdamW moments. With
                        --dtype fp32: fp32 parameters, gradients and AdamW state, fp32 compute.
  --precision autocast  fp32 parameters, gradients and AdamW state; --dtype bf16 computes under bf16 autocast
                        (FusedLinear casts each weight once per iteration): torch's AMP recipe
  --precision bf16      parameters, gradients and AdamW moments in bf16, no autocast: every layer reads and writes
                        bf16 (embedding output, residual adds, LayerNorm with fp32 statistics, stage boundaries),
                        the GEMMs read the weights as they are. torch's bf16-parameter recipe.
  --precision compact   the model as with bf16; the optimizer (grad_sync/compact_adamw.py) keeps each parameter's
                        fp32 master exactly, as the bf16 parameter plus an int16 remainder, and bf16 moments:
                        Transformer Engine's FusedAdam with store_param_remainders.

docs/PRECISION.md gives each recipe's bytes per parameter and numerics.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from peerline.distributed.config import RunConfig

_CPU = torch.device("cpu")


def compute_dtype(cfg: RunConfig, device: torch.device) -> str:
    """bf16 by default on a GPU, fp32 on the CPU, or what --dtype says."""
    return cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")


def resolve_autocast(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the iteration: bf16 for bf16 compute over fp32 weights (--precision autocast); None
    (no autocast) for fp32 compute and for bf16 weights, which compute in bf16 by themselves."""
    if bf16_parameters(cfg, device):
        return None
    return torch.bfloat16 if compute_dtype(cfg, device) == "bf16" else None


def bf16_parameters(cfg: RunConfig, device: torch.device = _CPU) -> bool:
    """Whether the model holds bf16 parameters: --precision bf16 and compact, and master with bf16 compute (the
    fp32 masters of those two are the optimizer's). `device` decides the default --dtype (bf16 on a GPU)."""
    if cfg.precision == "master":
        return compute_dtype(cfg, device) == "bf16"
    return cfg.precision in ("bf16", "compact")


def parameter_dtype(cfg: RunConfig, device: torch.device = _CPU) -> torch.dtype:
    return torch.bfloat16 if bf16_parameters(cfg, device) else torch.float32


def apply_precision(cfg: RunConfig, modules: list[nn.Sequential], first_stage_index: int | None,
                    device: torch.device | None = None) -> None:
    """Cast every floating parameter to the recipe's dtype (buffers, e.g. RoPE tables, stay fp32); with bf16
    weights, the first stage casts floating inputs (synthetic data is fp32) to bf16 on entry. `device`: the run's
    (the default --dtype follows it); by default the device the modules' parameters are on."""
    if device is None:
        device = next((p.device for m in modules for p in m.parameters()), _CPU)
    dtype = parameter_dtype(cfg, device)
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
