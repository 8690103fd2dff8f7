"""Master AdamW's step on a GPU: the fp32 master weights and fp32 moments of bf16 parameters updated from their
bf16 gradients, and every parameter rewritten as its master's bf16 rounding, in one multi-tensor launch per group
(master_adamw.cu). 28 bytes of memory traffic per parameter: read the gradient (2), master and moments (12); write
master and moments (12) and the parameter (2).

The arithmetic is torch's fused AdamW's, in the same types (master_adamw.cu's header), so on the same fp32 numbers
it gives what `torch._fused_adamw_` gives; grad_sync/master_adamw.py's CPU path is that torch op.

  MasterAdamWLaunch   one group's update: tables built once (not during capture), then one launch per step on
                      torch's current stream with lr and the step count as device scalars; no host sync, no
                      allocation, capturable
  build_tables(...)   the kernel's pointer and chunk tables (kernels/multi_tensor.py's layout)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from peerline.kernels.multi_tensor import CHUNK, THREADS, check_lists
from peerline.kernels.multi_tensor import build_tables as multi_tensor_tables

KERNEL_SOURCE = Path(__file__).resolve().parent / "master_adamw.cu"
_DTYPES = (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float32)
_NAMES = ("parameter", "gradient", "master", "exp_avg", "exp_avg_sq")


def build_tables(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """master_adamw.cu's tables, as host int64 tensors: `table` [7, T] (the five lists' pointers, numel, 1 where
    the vector path may run) and `chunks` [2, C] (each block's tensor and first element, CHUNK elements a block)."""
    lists = (params, grads, masters, exp_avgs, exp_avg_sqs)
    check_lists(lists, _DTYPES, _NAMES, params[0].device if params else torch.device("cpu"), "master AdamW")
    return multi_tensor_tables(lists)


class MasterAdamWLaunch:
    """The CUDA update of one group (same-length lists of contiguous CUDA tensors: bf16 params and grads, fp32
    masters and moments), its device tables built here, once (not during graph capture)."""

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                 exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]) -> None:
        table, chunks = build_tables(params, grads, masters, exp_avgs, exp_avg_sqs)
        self.device = params[0].device
        self.tensors = len(params)
        self.n_chunks = chunks.shape[1]
        self.table = table.to(self.device)
        self.chunks = chunks.to(self.device)
        # the tensors whose pointers the table holds stay alive as long as it does
        self.keep = [list(ts) for ts in (params, grads, masters, exp_avgs, exp_avg_sqs)]

    def __call__(self, lr: torch.Tensor, step: torch.Tensor, found_inf: torch.Tensor | None, *, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
        """Update every tensor on torch's current stream; `step`: the count of this step (already advanced, as
        torch's fused AdamW reads it); lr and step fp32 device scalars."""
        from peerline.kernels.compile import load_kernel
        from peerline.kernels.elementwise import launch_raw

        if self.n_chunks == 0:
            return
        kernel, _ = load_kernel(KERNEL_SOURCE, "pl_master_adamw", self.device.index)
        launch_raw(kernel, self.n_chunks, THREADS, "pipiqpppdddd",
                   (self.table.data_ptr(), self.tensors, self.chunks.data_ptr(), self.n_chunks, CHUNK, lr.data_ptr(),
                    step.data_ptr(), 0 if found_inf is None else found_inf.data_ptr(), beta1, beta2, eps,
                    weight_decay), self.device)
