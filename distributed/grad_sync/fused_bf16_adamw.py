"""`FusedBf16AdamW`: the optimizer of `--precision bf16` on a GPU. It is torch's AdamW (fused, capturable) over bf16
parameters, whose steps run kernels/fused_adamw.py's one launch per group: torch's fused AdamW's arithmetic in its
types, so parameters, moments and step counts are torch's, bit for bit, while the 14 bytes of memory traffic per
parameter move faster (on an H200 torch's kernel moves them at about 2.8 TB/s).

In everything else it is torch.optim.AdamW: the state (`step`, `exp_avg`, `exp_avg_sq` per parameter), the
state_dict and checkpoints, the hyperparameters, `found_inf` (the non-finite guard's on-device skip). torch's own
step runs where the kernel does not apply: a parameter's first step (torch creates its state), a closure, a
GradScaler's `grad_scale`, amsgrad, maximize, tensor hyperparameters. The kernel's tables hold the tensors'
addresses: they are rebuilt when any gradient or state tensor is another tensor than before (after
load_state_dict, say), which is refused during CUDA graph capture; lr lives in a device scalar per group,
refilled when the group's lr changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from peerline.kernels.fused_adamw import Bf16AdamWLaunch

_Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # param, grad, m, v, step


class FusedBf16AdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True, capturable=True) over bf16 CUDA parameters, stepping through our kernel (see
    the module doc)."""

    #: the non-finite guard hands `found_inf` to it (resilience/nonfinite.py)
    reads_found_inf = True

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True, capturable=True)
        bad = [p for g in self.param_groups for p in g["params"] if p.dtype != torch.bfloat16 or not p.is_cuda]
        if bad:
            raise ValueError(f"fused bf16 AdamW updates bf16 CUDA parameters; got {bad[0].dtype} on {bad[0].device}")
        self._launches: list[Bf16AdamWLaunch | None] | None = None
        self._built_from: list[list[_Entry]] = []
        self._lr: list[torch.Tensor] = []
        self._lr_value: list[float | None] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None or not self._kernel_applies():
            return super().step(closure)
        groups = [self._entries(group) for group in self.param_groups]
        if any(entries is None for entries in groups):
            return super().step()  # torch creates the new parameters' state (and steps them)
        if self._launches is None or not _same(groups, self._built_from):
            self._build(groups)
        steps = [e[4] for entries in groups for e in entries]
        if not steps:
            return None
        found_inf = getattr(self, "found_inf", None)
        torch._foreach_add_(steps, 1)  # as torch's _fused_adamw: the kernel reads the advanced counts
        for i, (group, launch) in enumerate(zip(self.param_groups, self._launches, strict=True)):
            if launch is not None:
                beta1, beta2 = group["betas"]
                launch(self._lr_of(i, group), found_inf, beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"])
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
        return None

    def _kernel_applies(self) -> bool:
        if getattr(self, "grad_scale", None) is not None:
            return False
        for group in self.param_groups:
            scalars = (group["lr"], group["eps"], group["weight_decay"], *group["betas"])
            if group["amsgrad"] or group["maximize"] or group["differentiable"] or any(map(torch.is_tensor, scalars)):
                return False
        return True

    def _entries(self, group: dict[str, Any]) -> list[_Entry] | None:
        """(param, grad, exp_avg, exp_avg_sq, step) of the group's parameters with a gradient; None when one of
        them has no state yet."""
        entries = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state.get(p)
            if not state or "exp_avg" not in state:
                return None
            entries.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
        return entries

    def _build(self, groups: list[list[_Entry]]) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused bf16 AdamW: gradients or state tensors changed since the kernel's tables were "
                               "built; building them cannot be captured into a CUDA graph: run a step eagerly first")
        self._launches = [Bf16AdamWLaunch(*(list(column) for column in zip(*entries, strict=True))) if entries
                          else None for entries in groups]
        self._built_from = groups
        if len(self._lr) != len(self.param_groups):
            device = self.param_groups[0]["params"][0].device
            self._lr = [torch.zeros((), dtype=torch.float32, device=device) for _ in self.param_groups]
            self._lr_value = [None] * len(self.param_groups)

    def _lr_of(self, i: int, group: dict[str, Any]) -> torch.Tensor:
        """The group's lr as a device fp32 scalar (torch's fused kernel rounds its double lr to fp32 alike),
        refilled only when the number changes: a captured step reads it from memory at every replay."""
        value = float(group["lr"])
        if self._lr_value[i] != value:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fused bf16 AdamW: lr changed during CUDA graph capture")
            self._lr[i].fill_(value)
            self._lr_value[i] = value
        return self._lr[i]


def _same(a: Sequence[Sequence[_Entry]], b: Sequence[Sequence[_Entry]]) -> bool:
    """Whether two groups' entries name the very same tensors."""
    return len(a) == len(b) and all(len(x) == len(y) and all(all(s is t for s, t in zip(e, f, strict=True))
                                                             for e, f in zip(x, y, strict=True))
                                    for x, y in zip(a, b, strict=True))
