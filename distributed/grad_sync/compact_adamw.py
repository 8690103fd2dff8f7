"""`CompactAdamW`: the optimizer of `--precision compact`, AdamW over bf16 parameters with exact fp32 masters.

The model holds bf16 parameters and bf16 gradients (as `--precision bf16`); this optimizer keeps, per parameter,
an int16 remainder that makes the fp32 master weight exactly recoverable from the bf16 parameter, and AdamW's
moments in bf16 (computed in fp32): 10 bytes per parameter with the gradient. The arithmetic and the bit layout
are kernels/compact_adamw.py's (Transformer Engine's `store_param_remainders`).

  step()   CUDA: one multi-tensor kernel per parameter group and a one-thread kernel that advances the step count;
           lr and the step count are device tensors, the pointer tables are built at the first step, so every
           later step is capturable into a CUDA graph (no host sync, no allocation). CPU: the same update in torch
           ops. `found_inf` (set by the non-finite guard, as on torch's fused AdamW): when non-zero the step leaves
           parameters, remainders, moments and the step count as they were.

State per parameter, as `state_dict()` shows it: `exp_avg`, `exp_avg_sq` (bf16, shaped like the parameter),
`master_remainder` (int16, shaped like the parameter) and `step` (a 0-dim fp32 tensor on the parameter's device,
one tensor shared by every parameter: they all step together). The state is created for every parameter at the
first step; a parameter whose `.grad` is None then is skipped (it keeps its values), as torch's AdamW does.
`load_state_dict` takes that layout back (moments of another dtype are cast to bf16; a missing `master_remainder`
starts at 0, i.e. the master is the bf16 parameter: a bf16-recipe state loads), with the same step for every
parameter. The parameters' storage must stay where it is (load weights in place), since the CUDA tables hold
pointers; the gradients must stay the same tensors (the run's bucket views), else the tables are rebuilt (refused
during capture).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from peerline.distributed.grad_sync.bf16_adamw_base import Bf16AdamWBase
from peerline.kernels.compact_adamw import CompactAdamWLaunch, advance_step, compact_adamw_step_

REMAINDER = "master_remainder"
_STATE_DTYPES = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, REMAINDER: torch.int16}


class CompactAdamW(Bf16AdamWBase):
    """AdamW over bf16 parameters with int16 master remainders and bf16 moments (see the module doc); torch's
    AdamW's arguments and defaults (amsgrad, maximize, foreach and fused are not offered)."""

    name = "compact AdamW"
    #: the per-parameter state entries a checkpoint keeps (resilience/checkpoint_names.py)
    state_keys = ("exp_avg", "exp_avg_sq", "step", REMAINDER)

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        self._launches: list[CompactAdamWLaunch | None] | None = None
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _invalidate(self) -> None:
        self._launches = None

    def _new_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """Moments and remainder at zero: the master is the bf16 parameter."""
        return {k: torch.zeros_like(param, dtype=dt, memory_format=torch.contiguous_format)
                for k, dt in _STATE_DTYPES.items()}

    def _clear_state(self, param: torch.nn.Parameter, state: dict[str, Any]) -> None:
        for key in _STATE_DTYPES:
            state[key].zero_()

    def _update(self, found_inf: torch.Tensor | None) -> None:
        if self.device.type == "cuda":
            self._step_cuda(found_inf)
        else:
            self._step_torch(found_inf)

    def _lists(self, group: Mapping[str, Any]) -> tuple[list[torch.Tensor], ...]:
        """(params, remainders, grads, exp_avgs, exp_avg_sqs) of the group's parameters that have a gradient."""
        params = [p for p in group["params"] if p.grad is not None]
        st = [self.state[p] for p in params]
        return (params, [s[REMAINDER] for s in st], [p.grad for p in params], [s["exp_avg"] for s in st],
                [s["exp_avg_sq"] for s in st])

    def _step_torch(self, found_inf: torch.Tensor | None) -> None:
        """The update in torch ops (the CPU path)."""
        if found_inf is not None and float(found_inf) != 0:
            return
        step = float(self.step_count) + 1
        for group in self.param_groups:
            params, rems, grads, ms, vs = self._lists(group)
            if params:
                beta1, beta2 = group["betas"]
                compact_adamw_step_(params, rems, grads, ms, vs, lr=float(group["lr"]), step=step, beta1=beta1,
                                    beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        self.step_count.add_(1)

    def _step_cuda(self, found_inf: torch.Tensor | None) -> None:
        """One kernel per group, then the step count: no host sync; tables rebuilt only when gradients moved."""
        grads, same = self._grad_lists()
        if self._launches is None or not same:
            self._build_launches(grads)
        for i, (group, launch) in enumerate(zip(self.param_groups, self._launches, strict=True)):
            if launch is None:
                continue
            beta1, beta2 = group["betas"]
            launch(self._lr_of(i, group), self.step_count, found_inf, beta1=beta1, beta2=beta2, eps=group["eps"],
                   weight_decay=group["weight_decay"])
        advance_step(self.step_count, found_inf)

    def _build_launches(self, grads: list[list[torch.Tensor | None]]) -> None:
        self._refuse_capture("the kernel's tables")
        launches = []
        for group in self.param_groups:
            lists = self._lists(group)
            launches.append(CompactAdamWLaunch(*lists) if lists[0] else None)
        self._launches = launches
        self._planned(grads)

    def _load_entries(self, state: dict[str, Any], entries: Mapping[str, Any], param: torch.Tensor) -> None:
        _load_remainder_entries(state, entries, param)


def _load_remainder_entries(state: dict[str, Any], entries: Mapping[str, Any], param: torch.Tensor) -> None:
    """Copy one parameter's saved moments and remainder into its state tensors (in place: the tables stay)."""
    for key, dtype in _STATE_DTYPES.items():
        value = entries.get(key)
        if value is None and key != REMAINDER:
            raise KeyError(f"compact AdamW state of a {tuple(param.shape)} parameter has no {key}")
        if value is None:
            state[key].zero_()
            continue
        value = torch.as_tensor(value)
        if value.numel() != param.numel():
            raise ValueError(f"{key} of {value.numel()} elements for a parameter of {param.numel()}")
        if key == REMAINDER and value.dtype != torch.int16:
            raise ValueError(f"{REMAINDER} must be int16, got {value.dtype}")
        state[key].copy_(value.reshape(param.shape).to(dtype))
