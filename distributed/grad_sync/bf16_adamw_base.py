"""What the two AdamWs over bf16 parameters share (compact_adamw.py's CompactAdamW, master_adamw.py's MasterAdamW):
bf16 parameters on one device, one step count for every parameter, lr as a device scalar for captured steps, a
plan of tensors built at the first step and kept while the gradients stay the same tensors, and the load of a
`state_dict()` whose every parameter steps together.

`step()` runs the closure, creates every parameter's state once (`_new_state`, with the shared step count) and
hands the update to `_update(found_inf)`. A subclass says its `name` (for messages), makes one parameter's state
in `_new_state`, updates in `_update`, forgets its plan in `_invalidate`, copies one parameter's saved entries in
`_load_entries` and clears one parameter's state for a fresh start in `_clear_state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


class Bf16AdamWBase(torch.optim.Optimizer):
    """torch.optim.Optimizer over bf16 parameters of one device, with AdamW's hyperparameters (see the module doc)."""

    #: the optimizer's name in messages ("compact AdamW")
    name = "bf16 AdamW"
    #: the non-finite guard's on-device skip: step() reads `found_inf` (resilience/nonfinite.py)
    reads_found_inf = True

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        self.step_count: torch.Tensor | None = None  # shared by every parameter's state
        self._ready = False  # every parameter has its state
        self._grads: list[list[torch.Tensor | None]] = []  # the gradient tensors the plan was built for
        self._lr: list[torch.Tensor] = []
        self._lr_value: list[float | None] = []
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        devices = {p.device for p in self._params()}
        if len(devices) > 1:
            raise ValueError(f"{self.name} keeps its parameters on one device; got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, for bf16 parameters only; the state and the plan follow at the next step."""
        super().add_param_group(param_group)
        bad = [p for p in self.param_groups[-1]["params"] if p.dtype != torch.bfloat16]
        if bad:
            self.param_groups.pop()
            raise ValueError(f"{self.name} updates bf16 parameters; got {bad[0].dtype} {tuple(bad[0].shape)}")
        self._ready, self._lr, self._lr_value = False, [], []
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget the plan (a subclass's tables or chunks): it is rebuilt at the next step."""

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def _grad_lists(self) -> tuple[list[list[torch.Tensor | None]], bool]:
        """Every group's gradients and whether they are the tensors the plan was built for."""
        grads = [[p.grad for p in group["params"]] for group in self.param_groups]
        return grads, _same(grads, self._grads)

    def _planned(self, grads: list[list[torch.Tensor | None]]) -> None:
        """Record the gradients a new plan is built for; the device lr scalars, once."""
        self._grads = grads
        if not self._lr:
            self._lr = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in self.param_groups]
            self._lr_value = [None] * len(self.param_groups)

    def _refuse_capture(self, what: str) -> None:
        """Building a plan allocates: one captured into a CUDA graph would be wrong, so it is refused."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.name}: the first step, or one whose gradient tensors changed, builds {what} "
                               "and cannot be captured into a CUDA graph; run it eagerly first")

    def _lr_of(self, i: int, group: Mapping[str, Any]) -> torch.Tensor:
        """The group's lr as a device fp32 scalar: its own tensor when it is one, else ours, refilled only when
        the number changes (a captured step reads it from memory at every replay)."""
        lr = group["lr"]
        if torch.is_tensor(lr) and lr.device == self.device and lr.dtype == torch.float32 and lr.dim() == 0:
            return lr
        value = float(lr)
        if self._lr_value[i] != value:
            self._lr[i].fill_(value)
            self._lr_value[i] = value
        return self._lr[i]

    def _new_step_count(self) -> None:
        if self.step_count is None:
            self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step of every parameter with a gradient: the closure, the state (once), `_update`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._init_state()
        self._update(getattr(self, "found_inf", None))
        return loss

    def _init_state(self) -> None:
        """Every parameter's state (`_new_state`) and the one step count they share, once."""
        if self._ready:
            return
        self._new_step_count()
        for p in self._params():
            state = self.state[p]
            if not state:
                state.update(self._new_state(p))
            state["step"] = self.step_count
        self._ready = True

    def _reset(self) -> None:
        """No state: the next step starts fresh (the tensors stay allocated, the plan valid)."""
        if self.step_count is None:
            return
        self._init_state()
        self.step_count.zero_()
        for p in self._params():
            self._clear_state(p, self.state[p])

    def _new_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _clear_state(self, param: torch.nn.Parameter, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, found_inf: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _load_entries(self, state: dict[str, Any], entries: Mapping[str, Any], param: torch.Tensor) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take a `state_dict()` back: hyperparameters per group, every parameter's state (or none: a fresh
        start, `_reset`), one step count; each parameter's entries through `_load_entries` (in place: the plan
        holds the state tensors)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state dict's parameter groups do not match the optimizer's")
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        params, saved_state = self._params(), state_dict["state"]
        held = [i for i in range(len(params)) if i in saved_state]
        if not held:
            self._reset()
            return
        if len(held) != len(params):
            raise ValueError(f"{self.name} steps every parameter together: the state holds {len(held)} of its "
                             f"{len(params)} parameters")
        steps = {float(saved_state[i]["step"]) for i in held}
        if len(steps) != 1:
            raise ValueError(f"{self.name} keeps one step count; the state has {sorted(steps)}")
        self._init_state()
        self.step_count.fill_(steps.pop())
        for i, p in enumerate(params):
            self._load_entries(self.state[p], saved_state[i], p)


def _same(a: list[list[torch.Tensor | None]], b: list[list[torch.Tensor | None]]) -> bool:
    """The same gradient tensors (identity), group by group."""
    return len(a) == len(b) and all(len(x) == len(y) and all(s is t for s, t in zip(x, y, strict=True))
                                    for x, y in zip(a, b, strict=True))
