"""The backward split into B (input gradient) and W (weight gradients), against one whole backward (float64)."""

import pytest
import torch
import torch.nn as nn

from peerline.distributed.pipeline import split_backward as SB
from peerline.kernels.fused_linear import FusedLinear


class Block(nn.Module):
    """Residual MLP with a LayerNorm, a biased torch Linear and a fused Linear (with and without bias)."""

    def __init__(self, h: int, impl: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = FusedLinear(h, 2 * h, bias=False, impl=impl)
        self.fc2 = FusedLinear(2 * h, h, impl=impl)
        self.out = nn.Linear(h, h)

    def forward(self, x):
        return self.out(x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


def _model(impl, seed):
    torch.manual_seed(seed)
    return nn.Sequential(Block(8, impl), Block(8, impl)).double()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _flat_grads(model):
    """Every .grad a view into one flat buffer, as GradBuckets makes them (the runtime's gradients)."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    start = 0
    for p in params:
        p.grad = flat[start:start + p.numel()].view_as(p)
        start += p.numel()


# "peerline" runs FusedLinear's own autograd Function (its weight GEMM deferred by B and run by W), the path every
# GPU run takes; on the CPU the main job resolves --kernels to torch, so this is where CI sees that path.
@pytest.mark.parametrize("impl", ["torch", "peerline"])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("grads", ["separate", "bucket views"])
def test_b_then_w_equals_one_backward(impl, last, grads):
    seed = int(torch.randint(0, 1 << 30, ()))
    ref, split = _model(impl, seed), _model(impl, seed)
    x0 = torch.randn(3, 5, 8, dtype=torch.float64)
    dy = torch.randn(3, 5, 8, dtype=torch.float64)
    for model in (ref, split):
        if grads == "separate":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            _flat_grads(model)
    finals = {id(p): 0 for p in split.parameters()}
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: finals.__setitem__(id(p), finals[id(p)] + 1))

    def out_and_grad(model):
        x = x0.clone().requires_grad_(True)
        y = model(x)
        return x, ([y.square().mean()], [None]) if last else ([y], [dy])

    xr, (outs, gouts) = out_and_grad(ref)
    torch.autograd.backward(outs, gouts)
    xs, (outs, gouts) = out_and_grad(split)
    pending = SB.backward_input(outs, gouts, [xs], list(split.parameters()))
    assert torch.allclose(xs.grad, xr.grad, rtol=1e-12, atol=1e-12)
    assert all(float(p.grad.abs().sum()) == 0 for p in split.parameters()), "B must not touch the weights"
    assert set(finals.values()) == {0}
    SB.backward_weight(pending, list(split.parameters()))
    for got, want in zip(_grads(split), _grads(ref)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in split.parameters()), \
        "W must not record its accumulation into .grad"
    assert set(finals.values()) == {1}, "each parameter's hooks run once, in W"


def test_input_without_gradient_runs_the_whole_backward_in_w():
    seed = int(torch.randint(0, 1 << 30, ()))
    ref, split = _model("peerline", seed), _model("peerline", seed)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    ref(x).sum().backward()
    pending = SB.backward_input([split(x).sum()], [None], [x], list(split.parameters()))
    assert all(p.grad is None for p in split.parameters())
    SB.backward_weight(pending, list(split.parameters()))
    for got, want in zip(_grads(split), _grads(ref)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
