"""Master weights across recipes on resume (resilience/run_state.py): an fp32 checkpoint's weights become MasterAdamW's
masters exactly and the bf16 parameters their rounding; a master checkpoint's masters become an autocast run's fp32
parameters. The load is driven as checkpoint.load_checkpoint drives it (template, filled in place, apply)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from peerline.distributed.grad_sync.master_adamw import MASTER, MasterAdamW
from peerline.distributed.resilience.checkpoint import CheckpointState
from peerline.distributed.resilience.run_state import RunState


def _run_state(module: nn.Sequential, optimizer: torch.optim.Optimizer) -> RunState:
    engine = SimpleNamespace(stages={0: SimpleNamespace(module=module)}, order=[0], optimizer=optimizer)
    rt = SimpleNamespace(engine=engine, layer_offsets={0: 0}, info=SimpleNamespace(rank=0), device=torch.device("cpu"))
    return RunState(rt)


def _resume(state: RunState, stored: dict[str, torch.Tensor]) -> None:
    template = state.template({k: tuple(v.shape) for k, v in stored.items()})
    for key, tensor in template.items():
        tensor.copy_(stored[key])  # as DCP fills the template
    state.apply(CheckpointState(iteration=2, tensors=template, manifest={}, folder=Path("ck")), 1e-3, {}, print)


def _stored(gen: torch.Generator, with_masters: bool) -> dict[str, torch.Tensor]:
    """A checkpoint of one Linear(4, 3): fp32 weights (autocast's), or bf16 weights with fp32 masters."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in (("layers.0.weight", (3, 4)), ("layers.0.bias", (3,))):
        weight = torch.randn(shape, generator=gen)
        out[f"model.{name}"] = weight.bfloat16() if with_masters else weight
        if with_masters:
            out[f"optim.{name}.{MASTER}"] = weight
        out[f"optim.{name}.exp_avg"] = torch.randn(shape, generator=gen)
        out[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=gen)
        out[f"optim.{name}.step"] = torch.tensor(2.0)
    return out


def test_fp32_weights_become_the_masters_exactly() -> None:
    stored = _stored(torch.Generator().manual_seed(0), with_masters=False)
    module = nn.Sequential(nn.Linear(4, 3)).to(torch.bfloat16)
    opt = MasterAdamW(module.parameters())
    _resume(_run_state(module, opt), stored)
    for name, p in (("layers.0.weight", module[0].weight), ("layers.0.bias", module[0].bias)):
        weight = stored[f"model.{name}"]
        assert not torch.equal(weight, weight.bfloat16().float()), "the test needs weights finer than bf16"
        assert torch.equal(opt.state[p][MASTER], weight)
        assert torch.equal(p.detach(), weight.bfloat16())
        assert torch.equal(opt.state[p]["exp_avg"], stored[f"optim.{name}.exp_avg"])
    assert float(opt.step_count) == 2


def test_masters_become_fp32_parameters() -> None:
    stored = _stored(torch.Generator().manual_seed(1), with_masters=True)
    module = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.AdamW(module.parameters())
    _resume(_run_state(module, opt), stored)
    for name, p in (("layers.0.weight", module[0].weight), ("layers.0.bias", module[0].bias)):
        assert torch.equal(p.detach(), stored[f"optim.{name}.{MASTER}"])
        assert MASTER not in opt.state[p]


def test_master_checkpoint_resumes_its_masters() -> None:
    stored = _stored(torch.Generator().manual_seed(2), with_masters=True)
    module = nn.Sequential(nn.Linear(4, 3)).to(torch.bfloat16)
    opt = MasterAdamW(module.parameters())
    state = _run_state(module, opt)
    assert all(t.dtype == torch.bfloat16 for k, t in state.template({k: tuple(v.shape) for k, v in stored.items()}
                                                                    ).items() if k.startswith("model."))
    _resume(state, stored)
    assert torch.equal(opt.state[module[0].weight][MASTER], stored[f"optim.layers.0.weight.{MASTER}"])
    assert torch.equal(module[0].weight.detach(), stored["model.layers.0.weight"])
