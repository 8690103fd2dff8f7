"""A rank's training state under the whole model's names, whatever the grid: what a checkpoint stores and loads.

Stage `s` of the model is an nn.Sequential of the layers [offset, offset + n) of the whole model, so its key
`3.fc1.weight` is the whole model's `layers.<offset + 3>.fc1.weight`: the same name on every grid (pp, dp,
interleaved stages). A checkpoint's keys:

  model.layers.17.fc1.weight                     the parameter or persistent buffer
  optim.layers.17.fc1.weight.exp_avg             AdamW's state of that parameter (exp_avg, exp_avg_sq, step; with
                                                 --precision compact also master_remainder, int16; with master
                                                 over bf16 parameters also master, the fp32 weight)
  rng.<rank>.torch / .cuda / .python / .numpy    a rank's RNG states (checkpoint.py encodes them as tensors)

Optimizer state comes from torch's AdamW (`state_dict()` / `load_state_dict`) or, for an optimizer that keeps only
a shard of it, from its `full_state()` / `load_full_state(state)`: per parameter name (its own names, translated
through its `names` mapping of parameter -> name when it has one), AdamW's entries as a plain AdamW holds them,
gathered over the data-parallel group (so calling it is collective over that group). An optimizer loads the
entries it names in its `state_keys` (compact AdamW: the moments, the step and `master_remainder`; master AdamW:
the moments, the step and `master`), else AdamW's: a compact checkpoint resumed under another recipe leaves its
remainders out, and a bf16 one resumed as compact starts its remainders at 0. The load's template holds every
moment in fp32 whatever the parameter's dtype (no stored moment is wider), so an fp32 state reaches master AdamW
unrounded and a bf16 one is cast once, by the optimizer's own load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from peerline.distributed.grad_sync.compact_adamw import REMAINDER  # compact AdamW's int16 low half of each master
from peerline.distributed.grad_sync.master_adamw import MASTER  # master AdamW's fp32 copy of each weight

MODEL = "model."
METADATA = ".metadata"  # DCP's file of which tensor is where (resilience/dcp_io.py reads it)
OPTIM = "optim."
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
STATE_KEYS = (*ADAM_KEYS, REMAINDER, MASTER)  # every per-parameter entry a checkpoint may hold


def global_name(local: str, offset: int) -> str:
    """`3.fc1.weight` of a stage whose first layer is the model's layer `offset` -> `layers.<offset+3>.fc1.weight`."""
    index, _, rest = local.partition(".")
    return f"layers.{offset + int(index)}" + (f".{rest}" if rest else "")


def stage_modules(stages: Iterable[tuple[nn.Module, int]]) -> dict[str, torch.Tensor]:
    """The state (parameters and persistent buffers) of (stage module, first layer) pairs by global name; the
    tensors are the modules' own (detached views), so loading into them loads the model."""
    found: dict[str, torch.Tensor] = {}
    for module, offset in stages:
        for key, value in module.state_dict().items():
            found[global_name(key, offset)] = value
    return found


def param_names(stages: Iterable[tuple[nn.Module, int]]) -> dict[nn.Parameter, str]:
    """Every parameter of the stages and its global name (a parameter shared inside a stage appears once)."""
    return {p: global_name(k, offset) for module, offset in stages for k, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# optimizer state by name


def is_sharded(optimizer: Any) -> bool:
    """An optimizer that keeps a shard of the state and speaks in full states (`full_state` / `load_full_state`)."""
    return callable(getattr(optimizer, "full_state", None)) and callable(getattr(optimizer, "load_full_state", None))


def _own_names(optimizer: Any, names: Mapping[nn.Parameter, str]) -> dict[str, str]:
    """A sharded optimizer's name of each parameter -> ours: through its `names` (parameter -> its name) when it
    has one, else its names are ours."""
    theirs = getattr(optimizer, "names", None)
    if isinstance(theirs, Mapping):
        return {theirs[p]: name for p, name in names.items() if p in theirs}
    return {name: name for name in names.values()}


def optimizer_state(optimizer: Any, names: Mapping[nn.Parameter, str]) -> dict[str, dict[str, Any]]:
    """Per parameter name, AdamW's state entries (parameters without state yet are absent). Collective over the
    data-parallel group for a sharded optimizer."""
    if is_sharded(optimizer):
        ours = _own_names(optimizer, names)
        return {ours[k]: v for k, v in optimizer.full_state().items() if k in ours}
    state = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {names[p]: dict(state[i]) for i, p in enumerate(params) if i in state and p in names}


def load_optimizer_state(optimizer: Any, names: Mapping[nn.Parameter, str], full: Mapping[str, Mapping[str, Any]]
                         ) -> None:
    """Put `full` (per parameter name, as `optimizer_state` returns) into the optimizer: torch's AdamW through
    its load_state_dict (which places `step` where its fused / capturable mode wants it), a sharded one through
    load_full_state. The optimizer's param_groups (the run's --lr) stay as they are."""
    keys = set(getattr(optimizer, "state_keys", ADAM_KEYS))
    full = {name: {k: v for k, v in entries.items() if k in keys} for name, entries in full.items()}
    if is_sharded(optimizer):
        theirs = {ours: their for their, ours in _own_names(optimizer, names).items()}
        optimizer.load_full_state({theirs[k]: dict(v) for k, v in full.items() if k in theirs})
        return
    current = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    current["state"] = {i: dict(full[names[p]]) for i, p in enumerate(params) if names.get(p) in full}
    optimizer.load_state_dict(current)


def flatten_optimizer(full: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """`optim.<name>.<entry>` tensors (a Python number, e.g. a step count kept as an int, becomes a float32
    scalar: AdamW's own step tensors are float32)."""
    flat = {}
    for name, entries in full.items():
        for key, value in entries.items():
            tensor = value.detach() if torch.is_tensor(value) else torch.tensor(float(value))
            flat[f"{OPTIM}{name}.{key}"] = tensor
    return flat


def optimizer_template(names: Iterable[tuple[str, torch.Tensor]], stored: Mapping[str, tuple[int, ...]]
                       ) -> dict[str, dict[str, torch.Tensor]]:
    """Empty CPU tensors for the optimizer entries the checkpoint holds of these (name, parameter) pairs, shaped
    as stored (`stored`: key -> shape), to be filled by the load: the step, masters and moments fp32 (or the
    parameter's dtype when wider), the remainders int16."""
    template: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in names:
        for key in STATE_KEYS:
            shape = stored.get(f"{OPTIM}{name}.{key}")
            if shape is not None:
                dtype = torch.int16 if key == REMAINDER else torch.promote_types(param.dtype, torch.float32)
                template.setdefault(name, {})[key] = torch.zeros(shape, dtype=dtype)
    return template
