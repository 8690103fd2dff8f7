"""--precision compact on a GPU: the compact AdamW kernel (kernels/compact_adamw.cu) against a float64 AdamW and the
CPU path on random inputs (tensors of many sizes, aligned and misaligned, laid out between guard elements that must
stay untouched), inside a CUDA graph (capture, replay with new gradients and a device lr, found_inf), without
allocations after the first step; and the GPT job with --precision compact (graph vs eager, vs --precision bf16,
pp=2 vs one GPU).

Tolerances: the kernel and the CPU path are both fp32 arithmetic on the recovered master (the kernel's FMAs and
powf round differently): the master within 3 fp32 ulps of float64 AdamW's (with fp32's step scalars) plus twice
fp32's rounding of the decay and update terms; moments within one bf16 ulp plus fp32's error on their terms.
Jobs: bf16 compute, 2e-2 (tests/gpu/test_gpt_gpu.py's bf16 bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run
from tests.gpu.optimizer_replay import (
    check_captured_steps_follow_reference,
    check_replay_reads_a_device_lr_and_found_inf,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
GUARD = 8  # guard elements before and after every tensor
SIZES = [1, 3, 4, 5, 1000, 32767, 32768, 32773, 3 * 32768 + 2, (1 << 20) + 7]
BF16_TOL = 2e-2


def _layout(sizes: list[int], misalign: list[int], dtype: torch.dtype, fill: int) -> tuple[torch.Tensor, list]:
    """One CUDA buffer holding a tensor of each size between GUARD elements whose bits are `fill` (offset by one
    more element where misalign is 1: 2-byte aligned pointers, the kernel's scalar path)."""
    offsets, at = [], 0
    for n, mis in zip(sizes, misalign, strict=True):
        at += GUARD + mis
        offsets.append(at)
        at += n + GUARD
        at += (-at) % 4
    buf = torch.full((at,), fill, dtype=torch.int16, device="cuda").view(dtype)
    return buf, [buf[o:o + n] for o, n in zip(offsets, sizes, strict=True)]


def _random_state(sizes: list[int], misalign: list[int], seed: int) -> dict[str, tuple[torch.Tensor, list]]:
    from peerline.kernels.compact_adamw import split_master

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for key, dtype in (("param", torch.bfloat16), ("rem", torch.int16), ("grad", torch.bfloat16),
                       ("m", torch.bfloat16), ("v", torch.bfloat16)):
        out[key] = _layout(sizes, misalign, dtype, 0x7FC1 if dtype == torch.bfloat16 else 0x5A5A)
    for i, n in enumerate(sizes):
        master = torch.randn(n, device="cuda", generator=gen) * 3
        out["param"][1][i].copy_(split_master(master)[0])
        out["rem"][1][i].copy_(torch.randint(-32768, 32768, (n,), device="cuda", generator=gen).to(torch.int16))
        out["grad"][1][i].copy_(torch.randn(n, device="cuda", generator=gen) * 0.1)
        out["m"][1][i].copy_(torch.randn(n, device="cuda", generator=gen) * 0.01)
        out["v"][1][i].copy_(torch.rand(n, device="cuda", generator=gen) * 1e-3)
    return out


def _float64_step(p, r, g, m, v, lr: float, wd: float, step: float) -> dict[str, torch.Tensor]:
    """AdamW in float64 on the recovered master with the step's scalars as fp32 computes them (adam_coefficients),
    and `slack`: fp32's rounding of the decay and update terms (tests/unit/test_compact_adamw.py's reference)."""
    from peerline.kernels.compact_adamw import adam_coefficients, combine_master

    c = adam_coefficients(lr=lr, step=step, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    master = combine_master(p, r).double()
    g = g.double()
    m_terms = c["beta1"] * m.double().abs() + c["one_minus_beta1"] * g.abs()
    m64 = c["beta1"] * m.double() + c["one_minus_beta1"] * g
    v64 = c["beta2"] * v.double() + c["one_minus_beta2"] * g * g
    denom = v64.sqrt() / c["bc2_sqrt"] + c["eps"]
    decay = c["lr_wd"] * master
    slack = 2.0 ** -21 * (decay.abs() + c["step_size"] * m_terms / denom)
    return {"master": master - decay - c["step_size"] * m64 / denom, "slack": slack, "m": m64, "v": v64,
            "m_terms": m_terms, "v_terms": v64}


def _ulp32(x: torch.Tensor) -> torch.Tensor:
    f = x.float().abs()
    return (torch.nextafter(f, torch.full_like(f, math.inf)) - f).double()


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    b = x.to(torch.bfloat16).float().abs()
    return ((b.view(torch.int32) + (1 << 16)).view(torch.float32) - b).double()


@pytest.mark.parametrize("misaligned", [False, True])
def test_kernel_matches_float64_and_the_cpu_path(misaligned: bool) -> None:
    from peerline.kernels.compact_adamw import CompactAdamWLaunch, combine_master, compact_adamw_step_

    lr, wd, count = 1e-2, 0.1, 7.0
    misalign = [int(misaligned and i % 2 == 0) for i in range(len(SIZES))]
    s = _random_state(SIZES, misalign, seed=3)
    before = {k: (buf.clone(), [t.clone() for t in ts]) for k, (buf, ts) in s.items()}
    step = torch.full((), count, device="cuda")
    CompactAdamWLaunch(*(s[k][1] for k in ("param", "rem", "grad", "m", "v")))(
        torch.full((), lr, device="cuda"), step, None, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    torch.cuda.synchronize()
    assert float(step) == count  # the launch reads the count; advance_step moves it
    for key, (buf, _) in s.items():  # the guards: untouched bits
        mask = torch.ones(buf.numel(), dtype=torch.bool, device="cuda")
        for t in s[key][1]:
            start = (t.data_ptr() - buf.data_ptr()) // t.element_size()
            mask[start:start + t.numel()] = False
        assert torch.equal(buf.view(torch.int16)[mask], before[key][0].view(torch.int16)[mask]), key
    cpu = {k: [t.cpu() for t in before[k][1]] for k in ("param", "rem", "grad", "m", "v")}
    compact_adamw_step_(cpu["param"], cpu["rem"], cpu["grad"], cpu["m"], cpu["v"], lr=lr, step=count + 1,
                        beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    for i, n in enumerate(SIZES):
        want = _float64_step(*(before[k][1][i].cpu() for k in ("param", "rem", "grad", "m", "v")), lr, wd, count + 1)
        got = combine_master(s["param"][1][i].cpu(), s["rem"][1][i].cpu()).double()
        bound = 3 * _ulp32(want["master"]) + 2 * want["slack"]
        assert ((got - want["master"]).abs() <= bound).all(), (n, (got - want["master"]).abs().max())
        on_cpu = combine_master(cpu["param"][i], cpu["rem"][i]).double()
        assert ((got - on_cpu).abs() <= bound + 2 * _ulp32(on_cpu)).all(), n
        for key in ("m", "v"):
            stored = s[key][1][i].cpu().double()
            slack = _ulp_bf16(want[key]) + 2.0 ** -21 * want[f"{key}_terms"]
            assert ((stored - want[key]).abs() <= slack).all(), (n, key)
            assert (stored != cpu[key][i].double()).float().mean() < 0.01, (n, key)


def _model_params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    shapes = [(1024, 1024), (1024,), (3, 77), (4096, 257), (5,)]
    return [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]


def _pair(lr: float = 1e-2) -> tuple:
    """The same parameters and gradients on the GPU (static gradient tensors) and on the CPU."""
    from peerline.distributed.grad_sync.compact_adamw import CompactAdamW

    cpu = _model_params(0)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    for p in gpu:
        p.grad = torch.zeros_like(p)
    return cpu, gpu, CompactAdamW(cpu, lr=lr), CompactAdamW(gpu, lr=lr)


def _set_grads(cpu, gpu, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for c, g in zip(cpu, gpu, strict=True):
        grad = (torch.randn(c.shape, generator=gen) * 0.1).to(torch.bfloat16)
        c.grad = grad
        g.grad.copy_(grad)  # in place: the captured step reads these tensors


def _assert_close(cpu, gpu, opt_cpu, opt_gpu) -> None:
    from peerline.distributed.grad_sync.compact_adamw import REMAINDER
    from peerline.kernels.compact_adamw import combine_master

    assert float(opt_gpu.step_count) == float(opt_cpu.step_count)
    for c, g in zip(cpu, gpu, strict=True):
        a = combine_master(c.detach(), opt_cpu.state[c][REMAINDER]).double()
        b = combine_master(g.detach().cpu(), opt_gpu.state[g][REMAINDER].cpu()).double()
        assert ((a - b).norm() / a.norm()).item() < 1e-5
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = opt_cpu.state[c][key].double(), opt_gpu.state[g][key].cpu().double()
            assert ((x - y).norm() / x.norm()).item() < 1e-2, key


def test_step_captured_in_a_cuda_graph_replays_with_new_gradients() -> None:
    cpu, gpu, opt_cpu, opt_gpu = _pair()
    check_captured_steps_follow_reference(opt_gpu, opt_cpu, lambda seed: _set_grads(cpu, gpu, seed),
                                          lambda: _assert_close(cpu, gpu, opt_cpu, opt_gpu))


def test_replay_reads_a_device_lr_and_found_inf() -> None:
    from peerline.distributed.grad_sync.compact_adamw import REMAINDER

    cpu, gpu, _, opt = _pair()
    _set_grads(cpu, gpu, 1)  # non-zero moments, so an lr of 1e-2 moves every parameter
    check_replay_reads_a_device_lr_and_found_inf(opt, gpu, REMAINDER)


# ---- the job ----

GPT = ("--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--micro-batch-size",
       "2", "--iters", "5", "--warmup-iters", "2", "--dtype", "bf16")
COMPACT = (*GPT, "--precision", "compact")
COMPACT_REF4 = Run("gpt_compact_ref4", (*COMPACT, "--no-graph", "-m", "4"))
PURE_REF4 = Run("gpt_pure_ref4", (*GPT, "--precision", "bf16", "--no-graph", "-m", "4"))

ONE_GPU = {
    "compact_graph_vs_eager": (Run("gpt_compact_g1", (*COMPACT, "--graph", "-m", "4")), COMPACT_REF4, True),
    "compact_vs_pure_bf16": (COMPACT_REF4, PURE_REF4, False),
}


@pytest.mark.parametrize("check", list(ONE_GPU))
def test_gpt_compact_one_gpu(pipeline_runs, check: str) -> None:
    got_run, ref_run, graph = ONE_GPU[check]
    got, ref = pipeline_runs.results(got_run, ref_run)
    assert_matches(got, ref, Expect(BF16_TOL, graph=graph))
    assert min(got["optimizer_state_bytes"]) > 0, got["optimizer_state_bytes"]


@pytest.mark.gpu2
def test_gpt_compact_pp2_matches_one_gpu(pipeline_runs) -> None:
    run = Run("gpt_compact_pp2", (*COMPACT, "--pp", "2", "-m", "4", "--schedule", "1f1b", "--graph"), nproc=2)
    got, ref = pipeline_runs.results(run, COMPACT_REF4)
    assert_matches(got, ref, Expect(BF16_TOL, world=2, graph=True))
