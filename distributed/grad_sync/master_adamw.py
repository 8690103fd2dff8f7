"""`MasterAdamW`: the optimizer of `--precision master` with bf16 compute, AdamW on fp32 master copies of bf16
parameters.

The model holds bf16 parameters and bf16 gradients (the bf16 recipe's model: the GEMMs read the weights as they
are, the weight-gradient GEMM accumulates into the bucket views); this optimizer keeps, per parameter, an fp32
master copy and AdamW's moments in fp32: 16 bytes per parameter with the parameter and its gradient. The update is
torch's fused AdamW's arithmetic on the masters, so it is fp32 AdamW on fp32 gradients (the bf16 gradients upcast
exactly).

  step()   On a GPU: one multi-tensor kernel per parameter group (kernels/fused_adamw.py: torch's fused AdamW's
           arithmetic in its types, the gradients upcast in registers, the parameters written as the masters'
           bf16 rounding; 28 bytes of memory traffic per parameter). On the CPU, per chunk of at most `chunk`
           elements (a parameter larger than that spans chunks as flat slices): upcast the bf16 gradients into one
           fp32 scratch (allocated at the first step, reused by every chunk), `torch._fused_adamw_` on the
           masters, copy the masters into the bf16 parameters (rounded to nearest even, `torch._foreach_copy_`).
           The step count and, on a GPU, lr are device tensors; the tables (GPU) or the chunk plan (CPU) are built
           at the first step, so every later step is capturable into a CUDA graph (no host sync, no allocation).
           `found_inf` (set by the non-finite guard, as on torch's fused AdamW): when non-zero the step leaves
           masters, moments and parameters as they were, and the step count goes back.

State per parameter, as `state_dict()` shows it: `master`, `exp_avg`, `exp_avg_sq` (fp32, shaped like the
parameter) and `step` (a 0-dim fp32 tensor on the parameter's device, one tensor shared by every parameter: they
all step together). The state is created for every parameter at the first step (the master from the parameter); a
parameter whose `.grad` is None then is skipped (it keeps its values), as torch's AdamW does. `load_state_dict`
takes that layout back: moments of another dtype are cast to fp32; a missing `master` starts from the parameter as
it is then (a bf16 or compact state loads: load the weights first); the parameters become the bf16 rounding of the
masters. The state tensors stay where they are (loads copy into them), since the tables and the chunk plan hold them;
the gradients must stay the same tensors (the run's bucket views), else the plan is rebuilt (refused during
capture).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from peerline.distributed.grad_sync.bf16_adamw_base import Bf16AdamWBase
from peerline.kernels.fused_adamw import MasterAdamWLaunch

MASTER = "master"
_FP32_STATE = (MASTER, "exp_avg", "exp_avg_sq")
#: elements per chunk: the fp32 gradient scratch is at most this long (64 MiB)
CHUNK = 1 << 24


@dataclass
class _Chunk:
    """One fused call's lists: flat slices of parameters, their gradients, masters and moments, and the scratch."""

    group: int
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    masters: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    scratch: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class MasterAdamW(Bf16AdamWBase):
    """AdamW over bf16 parameters with fp32 masters and fp32 moments (see the module doc); torch's AdamW's
    arguments and defaults (amsgrad, maximize, foreach and fused are not offered). `chunk`: elements of fp32
    gradient scratch per fused call of the CPU path (a GPU steps through one kernel per group)."""

    name = "master AdamW"
    #: the per-parameter state entries a checkpoint keeps (resilience/checkpoint_names.py)
    state_keys = ("exp_avg", "exp_avg_sq", "step", MASTER)

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 chunk: int = CHUNK) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 element, got {chunk}")
        self.chunk = chunk
        self._plan: list[_Chunk] | None = None
        self._launches: list[MasterAdamWLaunch | None] | None = None
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def _invalidate(self) -> None:
        self._plan = None
        self._launches = None

    def _update(self, found_inf: torch.Tensor | None) -> None:
        if self.device.type == "cuda":
            self._step_cuda(found_inf)
        else:
            self._step_chunks(found_inf)

    def _step_cuda(self, found_inf: torch.Tensor | None) -> None:
        """One kernel per group; tables rebuilt only when the gradients moved."""
        grads, same = self._grad_lists()
        if self._launches is None or not same:
            self._build_launches(grads)
        self.step_count.add_(1)
        for i, (group, launch) in enumerate(zip(self.param_groups, self._launches, strict=True)):
            if launch is not None:
                beta1, beta2 = group["betas"]
                launch(self._lr_of(i, group), self.step_count, found_inf, beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"])
        if found_inf is not None:
            self.step_count.sub_(found_inf.to(self.step_count.dtype))

    def _build_launches(self, grads: list[list[torch.Tensor | None]]) -> None:
        self._refuse_capture("the kernel's tables")
        launches: list[MasterAdamWLaunch | None] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and p.numel() > 0]
            st = [self.state[p] for p in params]
            launches.append(MasterAdamWLaunch(params, [p.grad for p in params], [s[MASTER] for s in st],
                                              [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st])
                            if params else None)
        self._launches = launches
        self._planned(grads)

    def _step_chunks(self, found_inf: torch.Tensor | None) -> None:
        """Per chunk: upcast the gradients, torch's fused AdamW on the masters, round into the parameters."""
        grads, same = self._grad_lists()
        if self._plan is None or not same:
            self._build_plan(grads)
        self.step_count.add_(1)
        for chunk in self._plan:
            group = self.param_groups[chunk.group]
            beta1, beta2 = group["betas"]
            torch._foreach_copy_(chunk.scratch, chunk.grads)
            torch._fused_adamw_(chunk.masters, chunk.scratch, chunk.exp_avgs, chunk.exp_avg_sqs, [],
                                [self.step_count] * len(chunk.masters), lr=self._lr_of(chunk.group, group),
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                amsgrad=False, maximize=False, grad_scale=None, found_inf=found_inf)
            torch._foreach_copy_(chunk.params, chunk.masters)
        if found_inf is not None:
            self.step_count.sub_(found_inf.to(self.step_count.dtype))

    def _new_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The master from the parameter, moments at zero."""
        master = param.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        return {MASTER: master, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}

    def _build_plan(self, grads: list[list[torch.Tensor | None]]) -> None:
        """Cut every group's parameters that have a gradient into chunks of at most `chunk` elements (flat slices)
        over one fp32 scratch."""
        self._refuse_capture("the chunk plan")
        plan: list[_Chunk] = []
        for gi, group in enumerate(self.param_groups):
            chunk = _Chunk(gi)
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                st = self.state[p]
                flats = [_flat(t, what) for t, what in ((p, "parameter"), (p.grad, "gradient"), (st[MASTER], MASTER),
                                                        (st["exp_avg"], "exp_avg"), (st["exp_avg_sq"], "exp_avg_sq"))]
                start = 0
                while start < p.numel():
                    if sum(chunk.lengths) == self.chunk:
                        plan.append(chunk)
                        chunk = _Chunk(gi)
                    stop = min(p.numel(), start + self.chunk - sum(chunk.lengths))
                    for lst, t in zip((chunk.params, chunk.grads, chunk.masters, chunk.exp_avgs, chunk.exp_avg_sqs),
                                      flats, strict=True):
                        lst.append(t[start:stop])
                    chunk.lengths.append(stop - start)
                    start = stop
            if chunk.lengths:
                plan.append(chunk)
        longest = max((sum(c.lengths) for c in plan), default=0)
        scratch = torch.empty(longest, dtype=torch.float32, device=self.device)
        for c in plan:
            c.scratch = list(torch.split(scratch[:sum(c.lengths)], c.lengths))
        self._plan = plan
        self._planned(grads)

    def _lr_of(self, i: int, group: Mapping[str, Any]) -> torch.Tensor | float:
        """The group's lr: a number on the CPU (torch's CPU fused AdamW takes one); on a GPU the base's device
        scalar, which a captured step reads from memory at every replay."""
        if self.device.type != "cuda":
            return float(group["lr"])
        return super()._lr_of(i, group)

    def _load_entries(self, state: dict[str, Any], entries: Mapping[str, Any], param: torch.Tensor) -> None:
        _load_master_entries(state, entries, param)

    def _clear_state(self, param: torch.nn.Parameter, state: dict[str, Any]) -> None:
        """The master back to the parameter, moments at zero."""
        state[MASTER].copy_(param.detach())
        state["exp_avg"].zero_()
        state["exp_avg_sq"].zero_()


def _load_master_entries(state: dict[str, Any], entries: Mapping[str, Any], param: torch.Tensor) -> None:
    """Copy one parameter's saved master and moments into its state tensors (in place: the plan stays), the
    master from the parameter when absent; then the parameter is the master's bf16 rounding."""
    for key in _FP32_STATE:
        value = entries.get(key)
        if value is None and key != MASTER:
            raise KeyError(f"master AdamW state of a {tuple(param.shape)} parameter has no {key}")
        if value is None:
            state[key].copy_(param.detach())
            continue
        value = torch.as_tensor(value)
        if value.numel() != param.numel():
            raise ValueError(f"{key} of {value.numel()} elements for a parameter of {param.numel()}")
        state[key].copy_(value.reshape(param.shape))
    with torch.no_grad():
        param.copy_(state[MASTER])


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    """A contiguous tensor as one flat view of its storage (writes through it reach the tensor)."""
    if not t.is_contiguous():
        raise ValueError(f"master AdamW needs contiguous tensors; a {tuple(t.shape)} {what} is not")
    return t.detach().view(-1)
