"""torch's fused AdamW in our own multi-tensor launches over bf16 parameters (fused_adamw.cu): the same arithmetic
in the same types, so on the same numbers it gives what torch's fused AdamW gives, at the memory's rate.

  MasterAdamWLaunch   one group of MasterAdamW (--precision master): fp32 masters and moments, bf16 gradients upcast
                      in registers, the parameters written as the masters' bf16 rounding; 28 bytes per parameter
                      (grad_sync/master_adamw.py; its CPU path is torch's fused AdamW on an fp32 scratch)
  Bf16AdamWLaunch     one group of torch's AdamW over bf16 parameters (--precision bf16): bf16 parameters,
                      gradients and moments, each parameter's own step count; 14 bytes per parameter
                      (grad_sync/fused_bf16_adamw.py)
  master_tables(...), bf16_tables(...)
                      their pointer and chunk tables (kernels/multi_tensor.py's layout)

A launch's tables are built once (not during graph capture); then each step is one launch on torch's current
stream with lr and the step counts as device scalars: no host sync, no allocation, capturable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from peerline.kernels.multi_tensor import MultiTensorLaunch, check_lists
from peerline.kernels.multi_tensor import build_tables as multi_tensor_tables

KERNEL_SOURCE = Path(__file__).resolve().parent / "fused_adamw.cu"
_MASTER = ((torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float32),
           ("parameter", "gradient", "master", "exp_avg", "exp_avg_sq"))
_BF16 = ((torch.bfloat16,) * 4, ("parameter", "gradient", "exp_avg", "exp_avg_sq"))


def master_tables(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                  exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """pl_master_adamw's tables, as host int64 tensors (one step count serves every tensor)."""
    lists = (params, grads, masters, exp_avgs, exp_avg_sqs)
    check_lists(lists, *_MASTER, _device(params), "master AdamW")
    return multi_tensor_tables(lists)


def bf16_tables(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """pl_bf16_adamw's tables, as host int64 tensors, with each tensor's fp32 step count."""
    lists, device = (params, grads, exp_avgs, exp_avg_sqs), _device(params)
    check_lists(lists, *_BF16, device, "fused bf16 AdamW")
    if len(steps) != len(params) or any(s.dtype != torch.float32 or s.numel() != 1 or s.device != device
                                        for s in steps):
        raise ValueError(f"fused bf16 AdamW: one fp32 step count on {device} per parameter")
    return multi_tensor_tables(lists, (steps,))


def _device(params: Sequence[torch.Tensor]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


class MasterAdamWLaunch(MultiTensorLaunch):
    """The CUDA update of one group (same-length lists of contiguous CUDA tensors: bf16 params and grads, fp32
    masters and moments)."""

    source, kernel = KERNEL_SOURCE, "pl_master_adamw"

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]) -> None:
        table, chunks = master_tables(params, grads, masters, exp_avgs, exp_avg_sqs)
        super().__init__(table, chunks, params[0].device, (params, grads, masters, exp_avgs, exp_avg_sqs))

    def __call__(self, lr: torch.Tensor, step: torch.Tensor, found_inf: torch.Tensor | None, *, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
        """Update every tensor on torch's current stream; `step`: the count of this step (already advanced, as
        torch's fused AdamW reads it); lr and step fp32 device scalars."""
        self._launch("pppdddd", (lr.data_ptr(), step.data_ptr(), 0 if found_inf is None else found_inf.data_ptr(),
                                 beta1, beta2, eps, weight_decay))


class Bf16AdamWLaunch(MultiTensorLaunch):
    """The CUDA update of one group (same-length lists of contiguous bf16 CUDA tensors: params, grads, moments;
    and each parameter's fp32 step count)."""

    source, kernel = KERNEL_SOURCE, "pl_bf16_adamw"

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor]) -> None:
        table, chunks = bf16_tables(params, grads, exp_avgs, exp_avg_sqs, steps)
        super().__init__(table, chunks, params[0].device, (params, grads, exp_avgs, exp_avg_sqs, steps))

    def __call__(self, lr: torch.Tensor, found_inf: torch.Tensor | None, *, beta1: float, beta2: float, eps: float,
                 weight_decay: float) -> None:
        """Update every tensor on torch's current stream, each with its own step count (already advanced); lr an
        fp32 device scalar."""
        self._launch("ppdddd", (lr.data_ptr(), 0 if found_inf is None else found_inf.data_ptr(), beta1, beta2, eps,
                                weight_decay))
