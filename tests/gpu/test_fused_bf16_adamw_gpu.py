"""--precision bf16's optimizer on a GPU (grad_sync/fused_bf16_adamw.py): torch's AdamW over bf16 parameters stepping
through kernels/fused_adamw.cu's pl_bf16_adamw must equal torch's own fused AdamW bit for bit (parameters, moments,
step counts): eagerly, captured in a CUDA graph and replayed with new gradients (nothing allocated after the first
steps), with found_inf skipping a step, after load_state_dict (the tables rebuilt); and the GPT job with
--precision bf16, graph against eager (tests/gpu/test_gpt_gpu.py's bound).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run
from tests.gpu.optimizer_replay import set_same_grads

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SHAPES = [(1024, 1024), (1024,), (3, 77), (4096, 257), (5,), (32771,)]


def _pair() -> tuple:
    """bf16 parameters under FusedBf16AdamW and equal copies under torch's fused AdamW, with static gradients."""
    from peerline.distributed.grad_sync.fused_bf16_adamw import FusedBf16AdamW

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p in (*ours, *ref):
        p.grad = torch.zeros_like(p)
    return (ours, ref, FusedBf16AdamW(ours, lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True, capturable=True))


def _assert_equal(ours, ref, opt, opt_ref) -> None:
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b), (tuple(a.shape), "parameter", (a.float() - b.float()).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], opt_ref.state[b][key]), (tuple(a.shape), key)


def test_steps_equal_torchs_fused_adamw_bit_for_bit() -> None:
    ours, ref, opt, opt_ref = _pair()
    for seed in range(4):
        set_same_grads(ours, ref, seed)
        opt.step()
        opt_ref.step()
    assert opt._launches is not None, "the kernel ran (the first step is torch's own)"
    _assert_equal(ours, ref, opt, opt_ref)


def test_captured_step_replays_with_new_gradients_and_allocates_nothing() -> None:
    ours, ref, opt, opt_ref = _pair()
    for seed in (0, 1):
        set_same_grads(ours, ref, seed)
        opt.step()
        opt_ref.step()
    set_same_grads(ours, ref, 2)
    opt_ref.step()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated, "a later step allocated"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for seed in (3, 4, 5):
        set_same_grads(ours, ref, seed)
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    _assert_equal(ours, ref, opt, opt_ref)


def test_found_inf_skips_and_load_state_dict_rebuilds() -> None:
    ours, ref, opt, opt_ref = _pair()
    for seed in (0, 1):
        set_same_grads(ours, ref, seed)
        opt.step()
        opt_ref.step()
    found_inf = torch.ones((), device="cuda")
    opt.found_inf = opt_ref.found_inf = found_inf
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["step"].clone()) for p in ours]
    set_same_grads(ours, ref, 2)
    opt.step()
    opt_ref.step()
    assert all(torch.equal(p, a) and torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["step"], s)
               for p, (a, m, s) in zip(ours, before, strict=True))
    found_inf.zero_()
    saved = opt.state_dict()
    opt.load_state_dict(saved)  # new state tensors: the kernel's tables must follow them
    for seed in (3, 4):
        set_same_grads(ours, ref, seed)
        opt.step()
        opt_ref.step()
    _assert_equal(ours, ref, opt, opt_ref)


GPT = ("--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--micro-batch-size",
       "2", "--iters", "5", "--warmup-iters", "2", "--dtype", "bf16", "--precision", "bf16", "-m", "4")


def test_gpt_bf16_graph_matches_eager(pipeline_runs) -> None:
    got, ref = pipeline_runs.results(Run("gpt_fused_bf16_g1", (*GPT, "--graph")),
                                     Run("gpt_fused_bf16_e1", (*GPT, "--no-graph")))
    assert_matches(got, ref, Expect(2e-2, graph=True))
