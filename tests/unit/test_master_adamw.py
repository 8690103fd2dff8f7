"""`--precision master` with bf16 compute (grad_sync/master_adamw.py): fp32 masters and moments of bf16 parameters.

MasterAdamW's step is torch's fused AdamW on fp32 copies fed the same (bf16-representable) gradients (to the bit in
one chunk, to fp32 rounding however the parameters are cut into chunks); its parameters are the bf16 rounding of
its masters; found_inf skips the step; its state_dict and checkpoint entries round-trip bit for bit; states of
other recipes load into it and its state into them; the recipe's configuration (bf16 parameters, no autocast, the
refused --shard-optimizer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.grad_sync.compact_adamw import REMAINDER, CompactAdamW
from peerline.distributed.grad_sync.master_adamw import MASTER, MasterAdamW
from peerline.distributed.grad_sync.sharded_adamw import make_adamw, optimizer_state_bytes
from peerline.distributed.precision import bf16_parameters, parameter_dtype, resolve_autocast
from peerline.distributed.resilience import checkpoint_names as names

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def _params(seed: int, shapes=((37, 11), (11,), (5, 3, 2))) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in shapes]


def _grads(params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in params]


def _step(opt, params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)  # the same gradient tensors every step, as the run's bucket views
    opt.step()


@pytest.mark.parametrize("chunk", [1 << 24, 64, 7])
def test_steps_equal_fused_fp32_adamw_and_parameters_round_the_masters(chunk: int) -> None:
    params = _params(0)
    copies = [nn.Parameter(p.detach().float()) for p in params]
    opt = MasterAdamW(params, lr=3e-2, weight_decay=0.1, chunk=chunk)
    ref = torch.optim.AdamW(copies, lr=3e-2, weight_decay=0.1, fused=True)
    for i in range(5):
        grads = _grads(params, 10 + i)
        _step(opt, params, grads)
        _step(ref, copies, [g.float() for g in grads])
    for p, q in zip(params, copies, strict=True):
        st = opt.state[p]
        if chunk == 1 << 24:  # the same calls: the same bits
            assert torch.equal(st[MASTER], q.detach()), "the master is fp32 AdamW's weight"
        # cut otherwise, the CPU kernel's vector body and tail (FMA or not) may round differently: a few fp32 ulps
        torch.testing.assert_close(st[MASTER], q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(st["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(st["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert torch.equal(p.detach(), st[MASTER].to(torch.bfloat16)), "the parameter is the master's rounding"
        assert st[MASTER].dtype == st["exp_avg"].dtype == torch.float32
    assert float(opt.step_count) == 5
    assert not torch.equal(opt.state[params[0]][MASTER], params[0].detach().float()), "updates below bf16 are kept"


def test_chunks_cut_parameters_into_slices_over_one_scratch() -> None:
    params = _params(1)
    opt = MasterAdamW(params, chunk=100)
    _step(opt, params, _grads(params, 2))
    lengths = [sum(c.lengths) for c in opt._plan]
    assert lengths == [100, 100, 100, 100, 48] and sum(lengths) == sum(p.numel() for p in params)
    scratch = {c.scratch[0].untyped_storage().data_ptr() for c in opt._plan}
    assert len(scratch) == 1 and opt._plan[0].scratch[0].dtype == torch.float32


def test_found_inf_skips_the_whole_step() -> None:
    params = _params(2)
    opt = MasterAdamW(params, lr=1e-2)
    _step(opt, params, _grads(params, 1))
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params}
    opt.found_inf = torch.ones(())
    _step(opt, params, _grads(params, 2))
    for p, (value, state) in before.items():
        assert torch.equal(p, value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
    opt.found_inf = torch.zeros(())
    _step(opt, params, _grads(params, 2))
    assert float(opt.step_count) == 2
    assert all(not torch.equal(p, before[p][0]) for p in params)


def test_parameters_without_a_gradient_keep_their_values() -> None:
    used, unused = nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([used, unused], lr=1e-2)
    used.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(used, unused) and torch.equal(unused, torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(opt.state[unused][MASTER], torch.ones(4))


def test_refuses_parameters_that_are_not_bf16() -> None:
    with pytest.raises(ValueError, match="master AdamW updates bf16 parameters; got torch.float32"):
        MasterAdamW([nn.Parameter(torch.ones(3))])


def test_state_is_twelve_bytes_per_parameter() -> None:
    """fp32 master, exp_avg and exp_avg_sq (12 bytes; with the bf16 parameter and gradient 16), plus the one
    step count, which optimizer_state_bytes counts once per parameter tensor."""
    params = _params(3)
    opt = MasterAdamW(params)
    _step(opt, params, _grads(params, 1))
    n = sum(p.numel() for p in params)
    assert optimizer_state_bytes(opt) == 12 * n + 4 * len(params)


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    a = _params(0)
    opt_a = MasterAdamW(a, lr=1e-2)
    for i in range(3):
        _step(opt_a, a, _grads(a, i))
    saved = opt_a.state_dict()
    assert set(saved["state"][0]) == {"exp_avg", "exp_avg_sq", "step", MASTER}
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = MasterAdamW(b, lr=1e-2)
    opt_b.load_state_dict({"state": {i: {k: v.clone() for k, v in e.items()} for i, e in saved["state"].items()},
                           "param_groups": saved["param_groups"]})
    for i in range(3, 5):
        _step(opt_a, a, _grads(a, i))
        _step(opt_b, b, _grads(b, i))
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in (MASTER, "exp_avg", "exp_avg_sq"))
    assert float(opt_b.step_count) == 5


def _checkpoint(opt, params) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of an optimizer (checkpoint_names: by name, flattened)."""
    return names.flatten_optimizer(names.optimizer_state(opt, {p: f"layers.0.w{i}" for i, p in enumerate(params)}))


def _load(opt, params, flat: dict[str, torch.Tensor]) -> None:
    """The load's path: the template's dtypes, filled as DCP fills it (copy_), then load_optimizer_state."""
    pn = {p: f"layers.0.w{i}" for i, p in enumerate(params)}
    template = names.optimizer_template(((n, p) for p, n in pn.items()), {k: tuple(v.shape) for k, v in flat.items()})
    for name, entries in template.items():
        for key, t in entries.items():
            t.copy_(flat[f"{names.OPTIM}{name}.{key}"])
    names.load_optimizer_state(opt, pn, template)


def test_checkpoint_names_round_trip_the_masters_exactly() -> None:
    a = _params(0)
    opt_a = MasterAdamW(a, lr=1e-2)
    for i in range(2):
        _step(opt_a, a, _grads(a, i))
    flat = _checkpoint(opt_a, a)
    assert {k.rsplit(".", 1)[1] for k in flat} == {"exp_avg", "exp_avg_sq", "step", MASTER}
    assert all(v.dtype == torch.float32 for v in flat.values())
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = MasterAdamW(b, lr=1e-2)
    _load(opt_b, b, flat)
    for p, q in zip(a, b, strict=True):
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in (MASTER, "exp_avg", "exp_avg_sq"))


def test_states_of_other_recipes_load_into_master_and_back() -> None:
    params = _params(4)
    compact = CompactAdamW(params, lr=1e-2)
    _step(compact, params, _grads(params, 1))
    flat = _checkpoint(compact, params)  # bf16 moments, int16 remainders, no masters
    opt = MasterAdamW(params, lr=1e-2)
    _load(opt, params, flat)
    for p in params:  # masters from the bf16 parameters, moments upcast exactly, remainders left out
        assert torch.equal(opt.state[p][MASTER], p.detach().float())
        assert torch.equal(opt.state[p]["exp_avg"], compact.state[p]["exp_avg"].float())
        assert REMAINDER not in opt.state[p]
    assert float(opt.step_count) == 1
    _step(opt, params, _grads(params, 2))
    back = CompactAdamW(params, lr=1e-2)  # a master state into compact: its masters and fp32 moments left / cast
    _load(back, params, _checkpoint(opt, params))
    assert all(torch.equal(back.state[p]["exp_avg"], opt.state[p]["exp_avg"].bfloat16()) for p in params)
    plain = torch.optim.AdamW(params, lr=1e-2)
    _load(plain, params, _checkpoint(opt, params))
    assert all(MASTER not in plain.state[p] for p in params)


def test_a_state_without_entries_starts_fresh_from_the_parameters() -> None:
    params = _params(5)
    opt = MasterAdamW(params, lr=1e-2)
    _step(opt, params, _grads(params, 1))
    with torch.no_grad():
        params[0].add_(1)
    opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
    assert float(opt.step_count) == 0
    assert torch.equal(opt.state[params[0]][MASTER], params[0].detach().float())
    assert not opt.state[params[0]]["exp_avg"].any()


def test_configuration() -> None:
    master = RunConfig(precision="master", dtype="bf16")
    assert bf16_parameters(master, CPU) and parameter_dtype(master, CPU) == torch.bfloat16
    assert resolve_autocast(master, CPU) is None  # the bf16 recipe's model: no autocast
    default = RunConfig()  # master: bf16 compute by default on a GPU, fp32 on the CPU
    assert parameter_dtype(default, GPU) == torch.bfloat16 and parameter_dtype(default, CPU) == torch.float32
    assert resolve_autocast(default, CPU) is None
    autocast = RunConfig(precision="autocast", dtype="bf16")
    assert parameter_dtype(autocast, GPU) == torch.float32 and resolve_autocast(autocast, GPU) == torch.bfloat16
    params = _params(0)
    assert isinstance(make_adamw(params, [], {}, lr=1e-3, on_gpu=False, precision="master"), MasterAdamW)
    fp32 = [nn.Parameter(p.detach().float()) for p in params]
    for precision in ("master", "autocast"):
        assert type(make_adamw(fp32, [], {}, lr=1e-3, on_gpu=False, precision=precision)) is torch.optim.AdamW


@pytest.mark.parametrize("extra", [{"dtype": "bf16"}, {"device": "cuda"}])
def test_shard_optimizer_takes_master_and_refuses_compact(extra) -> None:
    """master shards with bf16 compute (ShardedMasterAdamW; tests/multiproc/test_shard_optimizer.py runs it);
    compact does not yet."""
    for precision in ("master", "autocast", "bf16"):
        RunConfig(precision=precision, shard_optimizer=True, dp=2, **extra)
    with pytest.raises(ConfigError, match="--precision compact does not support --shard-optimizer yet"):
        RunConfig(precision="compact", shard_optimizer=True, dp=2, **extra)
