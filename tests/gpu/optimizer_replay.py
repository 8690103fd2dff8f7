"""The captured-step checks both bf16 AdamWs share (compact and master, grad_sync/bf16_adamw_base.py): a step
captured into a CUDA graph follows a reference optimizer with new gradients at every replay, allocates nothing after
its first step, and reads the lr and `found_inf` from device memory; and the gradients every optimizer test writes
into both of its sides."""

from __future__ import annotations

from collections.abc import Callable

import torch


def set_same_grads(ours: list[torch.Tensor], ref: list[torch.Tensor], seed: int) -> None:
    """Write the same fresh bf16 gradients (N(0, 0.1^2), from `seed`) into both sides' `.grad` tensors, in place."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for a, b in zip(ours, ref, strict=True):
        grad = (torch.randn(a.shape, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
        a.grad.copy_(grad)
        b.grad.copy_(grad)


def check_captured_steps_follow_reference(opt: torch.optim.Optimizer, opt_ref: torch.optim.Optimizer,
                                          set_grads: Callable[[int], None], assert_close: Callable[[], None]) -> None:
    """Two eager steps (the first builds what the step keeps), a third that must allocate nothing, then one step
    captured and replayed on three new gradients (`set_grads(seed)` writes both sides'), the reference stepping
    beside it; `assert_close` compares the two sides, and the step count must be 5."""
    set_grads(0)
    opt.step()
    opt_ref.step()
    set_grads(1)
    opt_ref.step()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()["allocation.all.allocated"]
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == stats, "a later step allocated"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for seed in (2, 3, 4):
        set_grads(seed)
        opt_ref.step()
        graph.replay()
    torch.cuda.synchronize()
    assert_close()
    assert float(opt.step_count) == 5


def check_replay_reads_a_device_lr_and_found_inf(opt: torch.optim.Optimizer, params: list[torch.Tensor],
                                                 master_key: str) -> None:
    """`params` hold non-zero gradients (so an lr of 1e-2 moves every one); `master_key`: the state entry that,
    with the parameter, is the exact fp32 master (an lr of 0 leaves both bit for bit)."""
    lr = torch.full((), 1e-2, device="cuda")
    opt.param_groups[0]["lr"] = lr
    found_inf = torch.zeros((), device="cuda")
    opt.found_inf = found_inf
    opt.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()

    def snapshot():
        return [(p.detach().clone(), opt.state[p][master_key].clone(), opt.state[p]["exp_avg"].clone())
                for p in params]

    lr.fill_(0.0)  # no decay, no update: parameters and masters keep their bits; moments and the count move
    first = snapshot()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, a) and torch.equal(opt.state[p][master_key], r) for p, (a, r, _) in zip(params, first))
    assert float(opt.step_count) == 2
    found_inf.fill_(1.0)  # skipped: nothing moves
    second = snapshot()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, a) and torch.equal(opt.state[p]["exp_avg"], m) for p, (a, _, m) in zip(params, second))
    assert float(opt.step_count) == 2
    found_inf.zero_()
    lr.fill_(1e-2)
    graph.replay()
    torch.cuda.synchronize()
    assert float(opt.step_count) == 3 and any(not torch.equal(p, a) for p, (a, _, _) in zip(params, second))
