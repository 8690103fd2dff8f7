"""The optimizer of a run: torch's AdamW, or with `--shard-optimizer` `ShardedAdamW`, AdamW over this rank's shards,
or with `--precision compact` grad_sync/compact_adamw.py's `CompactAdamW`, or with `--precision master` over bf16
parameters grad_sync/master_adamw.py's `MasterAdamW` (`ShardedMasterAdamW` over the shards with
`--shard-optimizer`).

`ShardedAdamW` is a `torch.optim.AdamW` whose parameters are the shard views of sharded.py's flat parameter
buffers (one per bucket), whose gradients are the reduce-scattered shards. So everything that drives the run's
optimizer keeps working unchanged: `step()` (fused and capturable on a GPU, `found_inf` read by the fused kernel for
the non-finite guard), step hooks, `param_groups` (the learning rate), `state_dict()` / `load_state_dict()` of
this rank's shards (a checkpoint resumed on the same grid). Its state per rank is about 1/dp of AdamW's.

After every step, a step post-hook (registered first, so it runs inside every `step()` however step is wrapped)
all-gathers the updated shards into the parameters: sharded.py's `after_step` (with --overlap-param-gather the
next iteration's start does, param_gather.py).

Checkpoints that move between grids use the full, unsharded view (`full_state` / `load_full_state`, below),
keyed by the full model's parameter names (`full_param_names`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from peerline.distributed.grad_sync.compact_adamw import CompactAdamW
from peerline.distributed.grad_sync.fused_bf16_adamw import FusedBf16AdamW
from peerline.distributed.grad_sync.master_adamw import MasterAdamW
from peerline.distributed.grad_sync.sharded import ShardedGradBuckets

FullState = dict[str, dict[str, torch.Tensor | int | float]]


def full_param_names(modules: Mapping[int, nn.Module], layer_offsets: Mapping[int, int]) -> dict[nn.Parameter, str]:
    """Each parameter's name in the whole model: '<global layer index>.<name inside the layer>' (the keys of the
    whole model as one nn.Sequential's state_dict). `modules`: global stage id -> its layers (an nn.Sequential);
    `layer_offsets`: global stage id -> the global index of its first layer."""
    names: dict[nn.Parameter, str] = {}
    for sid, module in modules.items():
        for i, layer in enumerate(module):
            for name, p in layer.named_parameters():
                names.setdefault(p, f"{layer_offsets[sid] + i}.{name}")
    return names


def make_adamw(params: Sequence[nn.Parameter], syncs: Sequence[Any], names: Mapping[nn.Parameter, str], lr: float,
               on_gpu: bool, precision: str = "master") -> torch.optim.Optimizer:
    """The run's optimizer: with --precision compact, CompactAdamW (grad_sync/compact_adamw.py: bf16 parameters,
    int16 master remainders, bf16 moments; one kernel per step on a GPU); with --precision master over bf16
    parameters (bf16 compute), MasterAdamW (grad_sync/master_adamw.py: fp32 masters and moments, torch's fused
    AdamW's arithmetic on them), ShardedMasterAdamW when sharded; else ShardedAdamW when every stage's gradient
    sync is sharded (--shard-optimizer, dp > 1); else with --precision bf16 on a GPU FusedBf16AdamW
    (grad_sync/fused_bf16_adamw.py: torch's fused AdamW stepping through our kernel); else torch's AdamW over
    `params` (fp32 master, autocast); fused and capturable on a GPU either way."""
    sharded = bool(syncs) and all(isinstance(s, ShardedGradBuckets) for s in syncs)
    if precision == "compact":
        if sharded:
            raise ValueError("--precision compact does not support --shard-optimizer")
        return CompactAdamW(params, lr=lr)
    if precision == "master" and any(p.dtype == torch.bfloat16 for p in params):
        return ShardedMasterAdamW(syncs, names, lr=lr) if sharded else MasterAdamW(params, lr=lr)
    if sharded:
        return ShardedAdamW(syncs, names, lr=lr, fused=on_gpu or None, capturable=on_gpu)
    if precision == "bf16" and on_gpu and params and all(p.dtype == torch.bfloat16 for p in params):
        return FusedBf16AdamW(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, fused=on_gpu or None, capturable=on_gpu)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state on this rank (moments and step counts; 0 before a step)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))


class ShardedState:
    """What a sharded optimizer adds to its base optimizer (torch's AdamW, or MasterAdamW): the shard views of
    sharded.py's buckets as its parameters, with the reduce-scattered gradient shards as their `.grad`; the
    all-gather after every step (a step post-hook, registered first); and the full, unsharded state for
    checkpoints. A subclass calls `_bind_shards` before its base's __init__ and `_hook_gather` after it, and says
    how one bucket's loaded state is taken (`_take_bucket_states`) and in which dtype (`_state_dtype`).

    `full_state()` -> {full parameter name: {entry: Tensor, "step": Tensor}}: what the unsharded optimizer would
    hold in `state[param]` (entries shaped like the parameter, on the parameter's device; `step` a 0-dim fp32
    tensor), gathered over the dp group. Collective: every rank of the dp group calls it, outside an iteration.
    Parameters that have no state yet (before the first step) are absent.

    `load_full_state(state)`: takes that same mapping (tensors on any device, `step` a tensor or a number), keeps
    only this rank's shard of each entry; not collective. Every parameter of this rank must be in `state`, or
    none of a bucket's (that bucket then starts fresh); parameters of other ranks' stages are ignored. The
    parameters' values are not touched: load the weights into the model as usual. Hyperparameters (lr, betas) are
    not part of it: they come from param_groups.
    """

    syncs: list[ShardedGradBuckets]
    names: dict[nn.Parameter, str]
    #: (sync, bucket index, the shard this optimizer updates) of every bucket, in order
    shards: list[tuple[ShardedGradBuckets, int, torch.Tensor]]

    def _bind_shards(self, syncs: Sequence[ShardedGradBuckets], names: Mapping[nn.Parameter, str]
                     ) -> list[torch.Tensor]:
        """The shards as parameters (their `.grad` the gradient shards); every sharded parameter must be named."""
        self.syncs = list(syncs)
        self.names = dict(names)
        self.shards = []
        for sync in self.syncs:
            for i, (shard, grad) in enumerate(zip(sync.param_shards, sync.grad_shards, strict=True)):
                shard.grad = grad
                self.shards.append((sync, i, shard))
        missing = [p for sync in self.syncs for b in sync.buckets for p in b.params if p not in self.names]
        if missing:
            raise ValueError(f"{len(missing)} sharded parameters have no full name")
        return [shard for _, _, shard in self.shards]

    def _hook_gather(self) -> None:
        self.register_step_post_hook(self._gather)  # type: ignore[attr-defined]

    @staticmethod
    def _gather(optimizer: ShardedState, _args: Any, _kwargs: Any) -> None:
        for sync in optimizer.syncs:
            sync.after_step()

    def shard_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (optimizer_state_bytes)."""
        return optimizer_state_bytes(self)  # type: ignore[arg-type]

    def full_state(self) -> FullState:
        """The unsharded state by full parameter name (collective over the dp group; see the class doc)."""
        out: FullState = {}
        for sync, i, shard in self.shards:
            st = self.state.get(shard)  # type: ignore[attr-defined]
            if not st:
                continue
            whole = {k: sync.gather_shard(i, v) for k, v in st.items() if k != "step"}
            b = sync.buckets[i]
            for p, start in zip(b.params, b.starts, strict=True):
                entry: dict[str, torch.Tensor | int | float] = {
                    k: v[start:start + p.numel()].view_as(p).clone() for k, v in whole.items()}
                entry["step"] = st["step"].detach().clone()
                out[self.names[p]] = entry
        return out

    def load_full_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Keep this rank's shard of each parameter's state in `state` (see the class doc)."""
        taken: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None, float | None]] = []
        for sync, i, shard in self.shards:
            b = sync.buckets[i]
            entries = [state.get(self.names[p]) for p in b.params]
            if all(e is None for e in entries):
                taken.append((shard, None, None))
                continue
            absent = [self.names[p] for p, e in zip(b.params, entries, strict=True) if e is None]
            if absent:
                raise KeyError(f"optimizer state of {absent[0]} missing (its bucket's other parameters have some)")
            steps = {float(e["step"]) for e in entries}
            if len(steps) != 1:
                raise ValueError(f"parameters sharing a bucket have different AdamW steps {sorted(steps)}")
            new: dict[str, torch.Tensor] = {}
            for key in [k for k in entries[0] if k != "step"]:
                whole = torch.zeros(b.numel, dtype=self._state_dtype(shard), device=shard.device)
                for p, start, e in zip(b.params, b.starts, entries, strict=True):
                    whole[start:start + p.numel()].copy_(torch.as_tensor(e[key]).reshape(-1))
                new[key] = sync.shard_of(i, whole).clone()
            taken.append((shard, new, steps.pop()))
        self._take_bucket_states(taken)

    def _state_dtype(self, shard: torch.Tensor) -> torch.dtype:
        return shard.dtype

    def _take_bucket_states(self, taken: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None, float | None]]
                            ) -> None:
        raise NotImplementedError


class ShardedAdamW(ShardedState, torch.optim.AdamW):
    """torch's AdamW over the shards of sharded.py's buckets (see the module doc and ShardedState). `syncs`: every
    local stage's ShardedGradBuckets; `names`: each parameter's full name (full_param_names); the rest: AdamW's
    arguments. Its state is in the shards' dtype (fp32 for fp32 parameters, bf16 with --precision bf16)."""

    def __init__(self, syncs: Sequence[ShardedGradBuckets], names: Mapping[nn.Parameter, str], **adamw: Any) -> None:
        torch.optim.AdamW.__init__(self, self._bind_shards(syncs, names), **adamw)
        self._hook_gather()

    def _take_bucket_states(self, taken: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None, float | None]]
                            ) -> None:
        group = self.param_groups[0]
        for shard, new, step in taken:
            if new is None:
                self.state.pop(shard, None)
                continue
            new["step"] = _step_tensor(step, shard.device, group)
            self.state[shard] = new


class ShardedMasterAdamW(ShardedState, MasterAdamW):
    """MasterAdamW over the bf16 shards of sharded.py's buckets: fp32 masters and moments of this rank's shards
    only (16 bytes per parameter / dp for the state), --precision master with --shard-optimizer. `syncs`, `names`:
    as ShardedAdamW; `lr`: MasterAdamW's."""

    def __init__(self, syncs: Sequence[ShardedGradBuckets], names: Mapping[nn.Parameter, str], lr: float) -> None:
        MasterAdamW.__init__(self, self._bind_shards(syncs, names), lr=lr)
        self._hook_gather()

    def _state_dtype(self, shard: torch.Tensor) -> torch.dtype:
        return torch.float32

    def _take_bucket_states(self, taken: list[tuple[torch.Tensor, dict[str, torch.Tensor] | None, float | None]]
                            ) -> None:
        """MasterAdamW's one step count: every bucket loaded at one step, or none (a fresh start); the
        masters of a state without them start from the shards."""
        steps = {step for _, new, step in taken if new is not None}
        if not steps:
            self._reset()
            return
        if len(steps) != 1 or any(new is None for _, new, _ in taken):
            raise ValueError(f"{self.name} steps every shard together; the state has steps {sorted(steps)} and "
                             f"{sum(new is None for _, new, _ in taken)} bucket(s) without state")
        step = steps.pop()
        self.load_state_dict({"param_groups": self.state_dict()["param_groups"],
                              "state": {i: {**new, "step": step} for i, (_, new, _) in enumerate(taken)}})


def _step_tensor(step: float, device: torch.device, group: Mapping[str, Any]) -> torch.Tensor:
    """AdamW's step count as torch keeps it: fp32 on the parameter's device when fused or capturable, else a
    CPU tensor of the default dtype."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(step, dtype=torch.float32, device=device)
    return torch.tensor(step, dtype=torch.get_default_dtype())
