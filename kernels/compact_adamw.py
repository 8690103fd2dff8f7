"""Compact AdamW's update: bf16 parameters whose fp32 master weights live on as int16 remainders, bf16 moments.

What it follows: Transformer Engine's `FusedAdam(master_weights=True, store_param_remainders=True)`
(transformer_engine/pytorch/optimizers/fused_adam.py and `AdamFunctorMasterParamRemainder` in
transformer_engine/common/multi_tensor/adam.cu). The fp32 master weight of a bf16 parameter p is never stored;
its low 16 bits are, as a signed int16 remainder r, and

  master bits (int32) = (p's bits as int16, sign-extended, << 16) + r (sign-extended)        combine_master
  split of a master:   r = its low 16 bits as int16; p = its high 16 bits + bit 15             split_master

i.e. when the low half is >= 0x8000 the high half rounds up and the remainder is negative, so p is the bf16
nearest the master (ties away from zero) and the master is recovered bit for bit. TE does the same with int16
arithmetic (the high half decremented when r < 0 before it reassembles the fp32, incremented after it splits).
Unlike TE, a NaN master splits into a quiet bf16 NaN of its sign and r = 0, so a NaN update stays NaN in the model
(TE's rounding carry turns the canonical NaN 0x7fffffff into -0.0); a NaN's payload is all that is not recovered.
Unlike TE's capturable mode, which refuses remainders, the kernel here is capturable: lr and the step count are
device scalars, the tensor tables are built once.

The AdamW arithmetic is torch's fused AdamW's, in fp32 (decoupled weight decay first, then the moments, then the
bias-corrected update; the step's scalars from fp32 hyperparameters: adam_coefficients), on the recovered master;
the moments are read from and stored back to bf16 (round to nearest even). Bytes per parameter: 2 parameter + 2
remainder + 2 gradient + 2 + 2 moments = 10.

  compact_adamw_step_(...)   the update in torch ops on any device: the CPU path and the GPU tests' reference
  adam_coefficients(...)     the step's scalars as the kernel computes them in fp32
  CompactAdamWLaunch         the CUDA path (compact_adamw.cu): one launch per group of tensors, then one
                             one-thread launch that advances the step count; no host sync, no allocation
  build_tables(...)          the kernel's pointer and chunk tables (the unit tests run the kernel's source as
                             host C++ over them)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from peerline.kernels.multi_tensor import MultiTensorLaunch, check_lists
from peerline.kernels.multi_tensor import build_tables as multi_tensor_tables

KERNEL_SOURCE = Path(__file__).resolve().parent / "compact_adamw.cu"
_NAN_QUIET = 0x40


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 parameter, int16 remainder) as compact_adamw.cu splits it (see the module doc)."""
    bits = master.contiguous().view(torch.int32)
    high = bits >> 16
    nan = torch.isnan(master)
    param = torch.where(nan, high | _NAN_QUIET, high + ((bits >> 15) & 1))
    remainder = torch.where(nan, 0, bits)
    return param.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def combine_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 remainder) -> the fp32 master weight, exactly (mod 2^32 integer arithmetic)."""
    bits = (param.contiguous().view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def adam_coefficients(*, lr: float, step: float, beta1: float, beta2: float, eps: float, weight_decay: float
                      ) -> dict[str, float]:
    """The step's scalars in fp32, as compact_adamw.cu computes them from fp32 hyperparameters (torch's fused
    AdamW does the same): beta1, beta2, 1 - beta1, 1 - beta2, eps, lr * wd, lr / (1 - beta1^t) and
    sqrt(1 - beta2^t), `step` = t the count after this step."""
    f = np.float32
    b1, b2, lr32, t = f(beta1), f(beta2), f(lr), f(step)
    return {"beta1": float(b1), "beta2": float(b2), "one_minus_beta1": float(f(1) - b1),
            "one_minus_beta2": float(f(1) - b2), "eps": float(f(eps)), "lr_wd": float(lr32 * f(weight_decay)),
            "step_size": float(lr32 / (f(1) - b1 ** t)), "bc2_sqrt": float(np.sqrt(f(1) - b2 ** t))}


def compact_adamw_step_(params: Sequence[torch.Tensor], remainders: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                        exp_avg_sqs: Sequence[torch.Tensor], *, lr: float, step: float, beta1: float, beta2: float,
                        eps: float, weight_decay: float) -> None:
    """One AdamW step in place, in torch ops: `step` is the step count after this step (1 for the first)."""
    c = adam_coefficients(lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for p, r, g, m, v in zip(params, remainders, grads, exp_avgs, exp_avg_sqs, strict=True):
        w = combine_master(p, r)
        g32 = g.float()
        m32 = m.float().mul_(c["beta1"]).add_(g32, alpha=c["one_minus_beta1"])
        v32 = v.float().mul_(c["beta2"]).addcmul_(g32, g32, value=c["one_minus_beta2"])
        w.sub_(w * c["lr_wd"])
        w.addcdiv_(m32, v32.sqrt().div_(c["bc2_sqrt"]).add_(c["eps"]), value=-c["step_size"])
        new_p, new_r = split_master(w)
        p.copy_(new_p.view_as(p))
        r.copy_(new_r.view_as(r))
        m.copy_(m32)
        v.copy_(v32)


def build_tables(params: Sequence[torch.Tensor], remainders: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """compact_adamw.cu's tables of these tensors, as host int64 tensors: `table` [7, T] (the five lists'
    pointers, numel, 1 where all five are 8-byte aligned) and `chunks` [2, C] (each block's tensor and first
    element, CHUNK elements a block): kernels/multi_tensor.py's."""
    lists = (params, remainders, grads, exp_avgs, exp_avg_sqs)
    check_lists(lists, _DTYPES, _NAMES, params[0].device if params else torch.device("cpu"), "compact AdamW")
    return multi_tensor_tables(lists)


class CompactAdamWLaunch(MultiTensorLaunch):
    """The CUDA update of one group of tensors (same-length lists of contiguous CUDA tensors: bf16 params, int16
    remainders, bf16 grads, bf16 moments), its device tables built here, once (not during graph capture)."""

    source, kernel = KERNEL_SOURCE, "pl_compact_adamw"

    def __init__(self, params: Sequence[torch.Tensor], remainders: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor]) -> None:
        table, chunks = build_tables(params, remainders, grads, exp_avgs, exp_avg_sqs)
        super().__init__(table, chunks, params[0].device, (params, remainders, grads, exp_avgs, exp_avg_sqs))

    def __call__(self, lr: torch.Tensor, step: torch.Tensor, found_inf: torch.Tensor | None, *, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
        """Update every tensor on torch's current stream; `step`: the count before this step (not advanced)."""
        self._launch("pppffff", (lr.data_ptr(), step.data_ptr(), 0 if found_inf is None else found_inf.data_ptr(),
                                 beta1, beta2, eps, weight_decay))


def advance_step(step: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """step += 1 on the device unless found_inf is non-zero (CUDA: one thread on torch's current stream)."""
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    kernel, _ = load_kernel(KERNEL_SOURCE, "pl_compact_adamw_advance", step.device.index)
    launch_raw(kernel, 1, 1, "pp", (step.data_ptr(), 0 if found_inf is None else found_inf.data_ptr()), step.device)


_DTYPES = (torch.bfloat16, torch.int16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
_NAMES = ("parameter", "remainder", "gradient", "exp_avg", "exp_avg_sq")
