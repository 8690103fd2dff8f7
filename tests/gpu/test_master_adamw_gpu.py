"""--precision master with bf16 compute on a GPU (grad_sync/master_adamw.py): MasterAdamW's step equals torch's fused
AdamW on fp32 copies fed the same bf16 gradients, captured in a CUDA graph (replays with new gradients, a device lr
and found_inf) without allocations after the first step, its parameters the bf16 rounding of its masters; and the
GPT job (graph vs eager, master vs --precision bf16, master vs autocast, pp=2 vs one GPU).

Tolerances: the step's kernel (kernels/master_adamw.cu) is torch's fused AdamW's arithmetic in its types, so with
the same device lr it matches torch's fused AdamW to the bit (test_step_is_torchs_fused_adamw_bit_for_bit). The
captured checks give torch's AdamW lr as a Python float (a double; ours reads a device fp32 scalar): 1e-6
relative. Jobs: bf16 compute, 2e-2 (tests/gpu/test_gpt_gpu.py's bf16 bound).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run
from tests.gpu.optimizer_replay import (
    check_captured_steps_follow_reference,
    check_replay_reads_a_device_lr_and_found_inf,
    set_same_grads,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

BF16_TOL = 2e-2


def _pair(lr: float = 1e-2, chunk: int = 1 << 20) -> tuple:
    """bf16 parameters under MasterAdamW and fp32 copies under torch's fused AdamW, on the GPU, with static
    gradient tensors (the captured step reads them)."""
    from peerline.distributed.grad_sync.master_adamw import MasterAdamW

    torch.manual_seed(0)
    shapes = [(1024, 1024), (1024,), (3, 77), (4096, 257), (5,)]
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    for p in (*ours, *ref):
        p.grad = torch.zeros_like(p)
    return (ours, ref, MasterAdamW(ours, lr=lr, weight_decay=0.1, chunk=chunk),
            torch.optim.AdamW(ref, lr=lr, weight_decay=0.1, fused=True, capturable=True))


def _assert_close(ours, ref, opt, opt_ref) -> None:
    from peerline.distributed.grad_sync.master_adamw import MASTER

    for a, b in zip(ours, ref, strict=True):
        master = opt.state[a][MASTER]
        torch.testing.assert_close(master, b.detach(), rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], opt_ref.state[b][key], rtol=1e-6, atol=1e-12)
        assert torch.equal(a.detach(), master.to(torch.bfloat16)), "the parameter is the master's rounding"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most fp32 units in the last place between two fp32 tensors (same sign assumed)."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def test_step_is_torchs_fused_adamw_bit_for_bit() -> None:
    """Three steps with weight decay over tensors with 4-element bodies and tails: the masters and moments equal
    torch's fused AdamW's on fp32 copies given the same device lr, bit for bit; the parameters are the masters'
    bf16 rounding."""
    from peerline.distributed.grad_sync.master_adamw import MASTER, MasterAdamW

    torch.manual_seed(0)
    shapes = [(1024, 1024), (1024,), (3, 77), (4096, 257), (5,), (32771,)]
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    for p in (*ours, *ref):
        p.grad = torch.zeros_like(p)
    opt = MasterAdamW(ours, lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1, fused=True,
                                capturable=True)
    for seed in range(3):
        set_same_grads(ours, ref, seed)
        opt.step()
        opt_ref.step()
    for a, b in zip(ours, ref, strict=True):
        got = {"master": opt.state[a][MASTER], "exp_avg": opt.state[a]["exp_avg"],
               "exp_avg_sq": opt.state[a]["exp_avg_sq"]}
        want = {"master": b.detach(), "exp_avg": opt_ref.state[b]["exp_avg"],
                "exp_avg_sq": opt_ref.state[b]["exp_avg_sq"]}
        for key in got:
            assert torch.equal(got[key], want[key]), (tuple(a.shape), key, f"{_ulps(got[key], want[key])} ulps")
        assert torch.equal(a.detach(), got["master"].to(torch.bfloat16)), "the parameter is the master's rounding"


@pytest.mark.parametrize("chunk", [1 << 24, 100_003])
def test_step_captured_in_a_cuda_graph_equals_fused_adamw(chunk: int) -> None:
    ours, ref, opt, opt_ref = _pair(chunk=chunk)
    check_captured_steps_follow_reference(opt, opt_ref, lambda seed: set_same_grads(ours, ref, seed),
                                          lambda: _assert_close(ours, ref, opt, opt_ref))


def test_replay_reads_a_device_lr_and_found_inf() -> None:
    from peerline.distributed.grad_sync.master_adamw import MASTER

    ours, ref, opt, _ = _pair()
    set_same_grads(ours, ref, 1)
    check_replay_reads_a_device_lr_and_found_inf(opt, ours, MASTER)


# ---- the job ----

GPT = ("--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--micro-batch-size",
       "2", "--iters", "5", "--warmup-iters", "2", "--dtype", "bf16")
MASTER = (*GPT, "--precision", "master")
MASTER_REF4 = Run("gpt_master_ref4", (*MASTER, "--no-graph", "-m", "4"))
PURE_REF4 = Run("gpt_pure_ref4", (*GPT, "--precision", "bf16", "--no-graph", "-m", "4"))
AUTOCAST_REF4 = Run("gpt_autocast_ref4", (*GPT, "--precision", "autocast", "--no-graph", "-m", "4"))

ONE_GPU = {
    "master_graph_vs_eager": (Run("gpt_master_g1", (*MASTER, "--graph", "-m", "4")), MASTER_REF4, True),
    "master_vs_pure_bf16": (MASTER_REF4, PURE_REF4, False),
    "master_vs_autocast": (MASTER_REF4, AUTOCAST_REF4, False),
}


@pytest.mark.parametrize("check", list(ONE_GPU))
def test_gpt_master_one_gpu(pipeline_runs, check: str) -> None:
    got_run, ref_run, graph = ONE_GPU[check]
    got, ref = pipeline_runs.results(got_run, ref_run)
    assert_matches(got, ref, Expect(BF16_TOL, graph=graph))
    assert min(got["optimizer_state_bytes"]) > 0, got["optimizer_state_bytes"]


@pytest.mark.gpu2
def test_gpt_master_pp2_matches_one_gpu(pipeline_runs) -> None:
    run = Run("gpt_master_pp2", (*MASTER, "--pp", "2", "-m", "4", "--schedule", "1f1b", "--graph"), nproc=2)
    got, ref = pipeline_runs.results(run, MASTER_REF4)
    assert_matches(got, ref, Expect(BF16_TOL, world=2, graph=True))
