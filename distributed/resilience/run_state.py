"""One rank's share of a run's checkpoint: what it saves and what it loads, by the whole model's names.

  state = RunState(rt)
  state.tensors()            model, optimizer and RNG tensors of this rank by checkpoint key (checkpoint_names.py)
  state.template(shapes)     the tensors a load fills: the stage modules' own (loaded in place), empty optimizer
                             entries for what the checkpoint holds of this rank's parameters, this rank's RNG
  state.apply(loaded, say)   optimizer state into the optimizer (torch's AdamW or a sharded one), RNG states,
                             the iteration, and the notices of a changed --lr or data

Master weights across recipes: an optimizer that keeps fp32 masters of bf16 parameters (master AdamW, whose
`state_keys` name `master`) resumed from a checkpoint without masters (autocast, fp32 master, bf16, compact) loads
each weight into an fp32 tensor of its own instead of the bf16 parameter; the weight becomes the master exactly and
the parameter its bf16 rounding. A checkpoint with masters resumed into fp32 parameters (autocast) gives them the
masters, not the bf16 weights.

Nothing here depends on the grid: a rank names its layers by global index and takes whatever the checkpoint holds
under those names, so a checkpoint of pp=2 loads into pp=1 and a dp=2 one into dp=1. The RNG states are per rank
of the saving grid (`rng.<rank>.*`): a rank restores its own when the checkpoint has it; on another grid the ranks
differ and training draws no random numbers (data and initialisation are counter-based and seeded per layer), so
nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_names as names


class RunState:
    """This rank's stages (module, first layer), optimizer, rank and device, as a checkpoint sees them."""

    def __init__(self, rt: Any) -> None:
        engine = rt.engine
        self.rt = rt
        self.stages: list[tuple[nn.Module, int]] = [(engine.stages[sid].module, rt.layer_offsets[sid])
                                                     for sid in engine.order]
        self.optimizer = engine.optimizer
        self.rank, self.device = rt.info.rank, rt.device
        self.param_names = names.param_names(self.stages)
        self._weights: dict[str, torch.Tensor] = {}  # name -> fp32 weight loaded to become a master (see above)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything this rank saves (collective over the dp group with a sharded optimizer)."""
        self.rt.engine.finish_parameter_gathers()  # --overlap-param-gather: the last step's gathers, first
        found = {names.MODEL + k: v for k, v in names.stage_modules(self.stages).items()}
        found.update(names.flatten_optimizer(names.optimizer_state(self.optimizer, self.param_names)))
        keys = ckpt.rng_keys(self.rank)
        found.update({keys[kind]: v for kind, v in ckpt.capture_rng(self.device).items()})
        return found

    def template(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """What this rank loads from a checkpoint of these stored shapes."""
        found = {names.MODEL + k: v for k, v in names.stage_modules(self.stages).items()}
        self._weights = self._weights_for_masters(shapes)
        found.update({names.MODEL + n: w for n, w in self._weights.items()})
        optim = names.optimizer_template(((n, p) for p, n in self.param_names.items()), shapes)
        found.update(names.flatten_optimizer(optim))
        for kind, key in ckpt.rng_keys(self.rank).items():
            if key in shapes:
                found[key] = torch.zeros(shapes[key], dtype=torch.float64 if "gauss" in kind else
                                         (torch.int64 if kind in ("python", "numpy") else torch.uint8))
        return found

    def apply(self, loaded: ckpt.CheckpointState, lr: float, manifest: dict[str, Any],
              say: Callable[[str], None]) -> int:
        """Put the loaded optimizer and RNG state in place (the model is loaded already); return the iteration."""
        optim: dict[str, dict[str, torch.Tensor]] = {}
        prefix = names.OPTIM
        for name in self.param_names.values():
            for key in names.STATE_KEYS:
                value = loaded.tensors.get(f"{prefix}{name}.{key}")
                if value is not None:
                    optim.setdefault(name, {})[key] = value
        if not optim and any(k.startswith(prefix) for k in loaded.tensors):
            raise ckpt.CheckpointError(f"checkpoint {loaded.folder} holds no optimizer state of this rank's layers")
        self._place_masters(optim)
        try:
            names.load_optimizer_state(self.optimizer, self.param_names, optim)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ckpt.CheckpointError(f"checkpoint optimizer state does not fit: {exc}".splitlines()[0]) from None
        rng = {kind: loaded.tensors[key] for kind, key in ckpt.rng_keys(self.rank).items() if key in loaded.tensors}
        if "torch" in rng:
            ckpt.restore_rng(rng, self.device)
        resume_notices(loaded.manifest, manifest, lr, say)
        return loaded.iteration


    def _weights_for_masters(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """fp32 tensors to load this rank's bf16 weights into, when the optimizer keeps masters and the checkpoint
        holds none of them (else nothing)."""
        if names.MASTER not in getattr(self.optimizer, "state_keys", ()):
            return {}
        if any(f"{names.OPTIM}{n}.{names.MASTER}" in shapes for n in self.param_names.values()):
            return {}
        return {n: torch.zeros(p.shape, dtype=torch.float32) for p, n in self.param_names.items()
                if p.dtype == torch.bfloat16 and names.MODEL + n in shapes}

    def _place_masters(self, optim: dict[str, dict[str, torch.Tensor]]) -> None:
        """The loaded fp32 weights become the masters and the parameters their rounding; a checkpoint's masters
        become fp32 parameters (see the module doc)."""
        params = {n: p for p, n in self.param_names.items()}
        with torch.no_grad():
            for name, weight in self._weights.items():
                params[name].copy_(weight)
                if name in optim:
                    optim[name][names.MASTER] = weight
            if names.MASTER in getattr(self.optimizer, "state_keys", ()):
                return
            for name, entries in optim.items():
                master = entries.get(names.MASTER)
                if master is not None and params[name].dtype == torch.float32:
                    params[name].copy_(master.reshape(params[name].shape))
        self._weights = {}


def resume_notices(saved: dict[str, Any], current: dict[str, Any], lr: float, say: Callable[[str], None]
                       ) -> None:
    """The resume's notices: a --lr other than the checkpoint's run had, data read otherwise."""
    before = (saved.get("config") or {}).get("lr")
    if isinstance(before, int | float) and float(before) != float(lr):
        say(f"notice: --lr {lr:g} differs from the checkpoint's {float(before):g}: using --lr {lr:g}")
    notice = ckpt.data_notice(saved, current)
    if notice:
        say(notice)
