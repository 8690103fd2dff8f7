"""--precision compact on the CPU: the master split and its exact recovery, one step of compact AdamW against a
float64 AdamW, 50 steps against fp32 AdamW (and plain bf16 AdamW, which drifts), the state_dict and checkpoint
round trips, the non-finite guard's found_inf, and the configuration."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.grad_sync.compact_adamw import REMAINDER, CompactAdamW
from peerline.distributed.grad_sync.sharded_adamw import make_adamw
from peerline.distributed.precision import parameter_dtype, resolve_autocast
from peerline.distributed.resilience import checkpoint_names as names
from peerline.kernels.compact_adamw import adam_coefficients, combine_master, compact_adamw_step_, split_master

pytestmark = pytest.mark.timeout(120)

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _bits(values: list[int]) -> torch.Tensor:
    """int32 bit patterns given as unsigned 32-bit numbers."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


EDGES = [
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x00007FFF, 0x00008000, 0x0000FFFF, 0x007FFFFF, 0x807FFFFF, 0x80008000,  # subnormals
    0x3F7FFFFF, 0xBF7FFFFF, 0x3F7F8000, 0x007FFFFF,  # the low half rounds up into the next exponent
    0x3F808000, 0x3F818000, 0xBF808000,  # ties: away from zero in magnitude
    0x7F7FFFFF, 0xFF7FFFFF,  # the largest finite floats: bf16 rounds them to +-inf; the master stays finite
    0x7F800000, 0xFF800000,  # +-inf
]


def test_split_and_combine_round_trip_every_non_nan_bit_pattern() -> None:
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    subnormal = torch.randint(-(1 << 23) + 1, 1 << 23, (1 << 14,), generator=gen, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([random, subnormal, subnormal | _bits([0x80000000]), _bits(EDGES)])
    master = bits.view(torch.float32)
    keep = ~torch.isnan(master)
    bits, master = bits[keep], master[keep]
    param, rem = split_master(master)
    assert param.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert torch.equal(combine_master(param, rem).view(torch.int32), bits)
    # the parameter is the bf16 nearest the master: torch's round to nearest even, except ties (away from zero)
    tie = (bits & 0xFFFF) == 0x8000
    rne = master.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(param.view(torch.int16)[~tie], rne[~tie])
    assert (param[tie].float().abs() > master[tie].abs()).all()
    # the remainder is signed: negative exactly where the high half rounded up
    assert torch.equal(rem < 0, (bits & 0x8000) != 0)


def test_edge_patterns_split_as_documented() -> None:
    master = _bits([0x3F7FFFFF, 0x7F7FFFFF, 0x00008000]).view(torch.float32)
    param, rem = split_master(master)
    assert param.view(torch.int16).tolist() == [0x3F80, 0x7F80, 0x0001]  # 1.0, +inf, the smallest bf16 subnormal
    assert rem.tolist() == [-1, -1, -0x8000]


def test_nan_master_stays_nan_in_the_model() -> None:
    master = _bits([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFFFF8000]).view(torch.float32)
    param, rem = split_master(master)
    assert torch.isnan(param.float()).all() and (rem == 0).all()
    assert torch.isnan(combine_master(param, rem)).all()
    # the signs are kept
    assert torch.equal(torch.signbit(param.float()), torch.signbit(master))


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A mid-training state: masters of both signs, random remainders, moments of a few steps."""
    gen = torch.Generator().manual_seed(seed)
    param, _ = split_master(torch.randn(n, generator=gen) * 3)
    return {"param": param,
            "rem": torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int32).to(torch.int16),
            "grad": (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16),
            "m": (torch.randn(n, generator=gen) * 0.01).to(torch.bfloat16),
            "v": (torch.rand(n, generator=gen) * 1e-3).to(torch.bfloat16)}


def reference_step(s: dict[str, torch.Tensor], lr: float, wd: float, step: float) -> dict[str, torch.Tensor]:
    """AdamW in float64 on the recovered master, torch's order (decoupled decay first), with the stored bf16
    moments as the previous ones and the step's scalars (1 - beta1, lr * wd, the bias corrections, ...) as fp32
    computes them from fp32 hyperparameters (adam_coefficients: torch's fused AdamW and the kernel do so).
    Returns the new master, the unrounded moments, and `slack`: fp32's rounding of the update's terms."""
    c = adam_coefficients(lr=lr, step=step, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    master = combine_master(s["param"], s["rem"]).double()
    g = s["grad"].double()
    m_terms = c["beta1"] * s["m"].double().abs() + c["one_minus_beta1"] * g.abs()
    m = c["beta1"] * s["m"].double() + c["one_minus_beta1"] * g
    v = c["beta2"] * s["v"].double() + c["one_minus_beta2"] * g * g
    denom = v.sqrt() / c["bc2_sqrt"] + c["eps"]
    decay = c["lr_wd"] * master
    update = c["step_size"] * m / denom
    slack = 2.0 ** -21 * (decay.abs() + c["step_size"] * m_terms / denom)
    return {"master": master - decay - update, "m": m, "v": v, "m_terms": m_terms, "slack": slack}


def _ulp32(x: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing at |x| (float64)."""
    f = x.float().abs()
    return (torch.nextafter(f, torch.tensor(math.inf)) - f).double()


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    b = x.to(torch.bfloat16).float().abs()
    up = (b.view(torch.int32) + (1 << 16)).view(torch.float32)
    return (up - b).double()


@pytest.mark.parametrize("n, lr, wd, step", [(10007, 1e-2, 0.1, 8.0), (64, 1e-3, 0.0, 1.0), (4099, 3e-4, 0.01, 500.0)])
def test_one_step_equals_float64_adamw_on_the_master(n, lr, wd, step) -> None:
    """One step from a random state: the recovered master within 2 fp32 ulps of float64 AdamW's plus fp32's
    rounding of the decay and update terms (2^-21 of them: where the first moment's terms cancel, its relative
    error grows); each stored moment within one bf16 ulp of float64's plus fp32's error on its two terms, and
    the nearest bf16 but for under 1% of them; the parameter the bf16 nearest the new master."""
    s = _state(n, seed=n)
    want = reference_step(s, lr, wd, step)
    p, r, m, v = (s[k].clone() for k in ("param", "rem", "m", "v"))
    compact_adamw_step_([p], [r], [s["grad"]], [m], [v], lr=lr, step=step, beta1=BETA1, beta2=BETA2, eps=EPS,
                        weight_decay=wd)
    got = combine_master(p, r).double()
    assert ((got - want["master"]).abs() <= 2 * _ulp32(want["master"]) + want["slack"]).all()
    assert torch.equal(p.view(torch.int16), split_master(got.float())[0].view(torch.int16))
    terms = {"m": want["m_terms"], "v": want["v"]}
    for key in ("m", "v"):
        stored = {"m": m, "v": v}[key].double()
        assert ((stored - want[key]).abs() <= _ulp_bf16(want[key]) + 2.0 ** -21 * terms[key]).all(), key
        nearest = want[key].to(torch.bfloat16).double()
        assert (stored != nearest).float().mean() < 0.01, key


def _train(kind: str, init: torch.Tensor, target: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` AdamW steps on 0.5 |w - target|^2 plus noise, the gradient taken at the model's weights and
    stored in bf16 (fp32 for the fp32 run); returns the master weights (float64)."""
    if kind == "fp32":
        w = nn.Parameter(init.float().clone())
        opt: torch.optim.Optimizer = torch.optim.AdamW([w], lr=1e-3)
    else:
        w = nn.Parameter(init.clone())
        opt = CompactAdamW([w], lr=1e-3) if kind == "compact" else torch.optim.AdamW([w], lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        g = (w.detach().float() - target) + 0.1 * torch.randn(w.shape, generator=gen)
        w.grad = g.to(torch.bfloat16).to(w.dtype)
        opt.step()
    if kind == "compact":
        return combine_master(w.detach(), opt.state[w][REMAINDER]).double()
    return w.detach().double()


def test_fifty_steps_track_fp32_adamw_where_bf16_adamw_drifts() -> None:
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(4096, generator=gen).to(torch.bfloat16)
    target = torch.randn(4096, generator=gen)
    ref = _train("fp32", init, target, 50)
    moved = (ref - init.double()).norm()
    errors = {}
    for kind in ("compact", "bf16"):
        diff = (_train(kind, init, target, 50) - ref).norm()
        errors[kind] = (diff / ref.norm()).item(), (diff / moved).item()
    compact, bf16 = errors["compact"], errors["bf16"]
    assert compact[0] < 1e-3 and compact[1] < 0.02, errors  # relative to the master, and to how far it moved
    assert bf16[0] > 20 * compact[0], errors  # bf16 parameters lose most updates of lr 1e-3 to rounding


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(torch.bfloat16)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def test_state_dict_round_trip_continues_bit_for_bit() -> None:
    a = _model(0)
    opt_a = CompactAdamW(a.parameters(), lr=1e-2)
    _steps(a, opt_a, 3, seed=1)
    saved = opt_a.state_dict()
    entry = saved["state"][0]
    assert set(entry) == {"exp_avg", "exp_avg_sq", "step", REMAINDER}
    assert entry[REMAINDER].dtype == torch.int16 and entry["exp_avg"].dtype == torch.bfloat16
    assert float(entry["step"]) == 3
    b = _model(5)
    b.load_state_dict(a.state_dict())
    opt_b = CompactAdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict({"state": {i: {k: v.clone() for k, v in e.items()} for i, e in saved["state"].items()},
                           "param_groups": saved["param_groups"]})
    _steps(a, opt_a, 2, seed=2)
    _steps(b, opt_b, 2, seed=2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", REMAINDER):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])
    assert float(opt_b.step_count) == 5


def test_checkpoint_names_round_trip_the_remainders() -> None:
    """What a checkpoint stores and loads (checkpoint_names: by name, flattened, the load's template dtypes)."""
    a = _model(0)
    opt_a = CompactAdamW(a.parameters(), lr=1e-2)
    _steps(a, opt_a, 2, seed=1)
    pn_a = {p: f"layers.0.{k}" for k, p in a.named_parameters()}
    flat = names.flatten_optimizer(names.optimizer_state(opt_a, pn_a))
    assert any(k.endswith("." + REMAINDER) for k in flat)
    b = _model(5)
    b.load_state_dict(a.state_dict())
    pn_b = {p: f"layers.0.{k}" for k, p in b.named_parameters()}
    template = names.optimizer_template(((n, p) for p, n in pn_b.items()), {k: tuple(v.shape) for k, v in flat.items()})
    assert all(e[REMAINDER].dtype == torch.int16 for e in template.values())
    for name, entries in template.items():
        for key, t in entries.items():
            t.copy_(flat[f"{names.OPTIM}{name}.{key}"])
    opt_b = CompactAdamW(b.parameters(), lr=1e-2)
    names.load_optimizer_state(opt_b, pn_b, template)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(combine_master(p.detach(), opt_a.state[p][REMAINDER]),
                           combine_master(q.detach(), opt_b.state[q][REMAINDER]))
    # a compact checkpoint into torch's AdamW: the remainders are left out; an AdamW state into compact: they start at 0
    adamw = torch.optim.AdamW(b.parameters(), lr=1e-2)
    names.load_optimizer_state(adamw, pn_b, template)
    assert all(REMAINDER not in adamw.state[q] for q in b.parameters())
    plain = {n: {k: v for k, v in e.items() if k != REMAINDER} for n, e in template.items()}
    opt_c = CompactAdamW(b.parameters(), lr=1e-2)
    names.load_optimizer_state(opt_c, pn_b, plain)
    assert all((opt_c.state[q][REMAINDER] == 0).all() for q in b.parameters())


def test_found_inf_skips_the_whole_step() -> None:
    model = _model(0)
    opt = CompactAdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 1, seed=1)
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()}
    opt.found_inf = torch.ones(())
    _steps(model, opt, 1, seed=2)
    for p, (value, state) in before.items():
        assert torch.equal(p, value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
    opt.found_inf = torch.zeros(())
    _steps(model, opt, 1, seed=2)
    assert float(opt.step_count) == 2
    assert any(not torch.equal(p, before[p][0]) for p in model.parameters())


def test_parameters_without_a_gradient_keep_their_values() -> None:
    used, unused = nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = CompactAdamW([used, unused], lr=1e-2)
    used.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(used, unused) and torch.equal(unused, torch.ones(4, dtype=torch.bfloat16))
    assert (opt.state[unused][REMAINDER] == 0).all()


def test_refuses_parameters_that_are_not_bf16() -> None:
    with pytest.raises(ValueError, match="compact AdamW updates bf16 parameters; got torch.float32"):
        CompactAdamW([nn.Parameter(torch.ones(3))])


def test_configuration() -> None:
    cfg = RunConfig(precision="compact")
    assert parameter_dtype(cfg) == torch.bfloat16
    assert resolve_autocast(cfg, torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="--precision compact keeps the weights in bf16 and needs --dtype bf16"):
        RunConfig(precision="compact", dtype="fp32")
    with pytest.raises(ConfigError, match="--precision compact does not support --shard-optimizer yet"):
        RunConfig(precision="compact", shard_optimizer=True, dp=2)
    params = list(_model(0).parameters())
    opt = make_adamw(params, [], {}, lr=1e-3, on_gpu=False, precision="compact")
    assert isinstance(opt, CompactAdamW) and opt.defaults["weight_decay"] == 1e-2  # torch AdamW's defaults
