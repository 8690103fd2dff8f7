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


def _fused_weights(model):
    return {id(m.weight) for m in model.modules() if isinstance(m, FusedLinear)}


# "peerline" runs FusedLinear's own autograd Function (its weight GEMM deferred by B and run by W), the path every
# GPU run takes; the fused weights hold most of the parameters, so B takes the lean form (the graph freed, the
# other parameters' gradients in B). "torch" keeps plain Linears: the graph form (B touches no parameter).
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
    deferred = _fused_weights(split) if impl == "peerline" else {id(p) for p in split.parameters()}
    for p, want in zip(split.parameters(), ref.parameters()):
        if id(p) in deferred:
            assert float(p.grad.abs().sum()) == 0, "B must leave the deferred weights to W"
            assert finals[id(p)] == 0
        else:
            assert torch.allclose(p.grad, want.grad, rtol=1e-12, atol=1e-12)
            assert finals[id(p)] == 1
    if impl == "peerline":
        assert not pending.groups and not pending.roots and len(pending.queue) == 4
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.backward(outs, gouts)  # the lean form freed the graph
    else:
        assert pending.groups and not pending.queue
    SB.backward_weight(pending, list(split.parameters()))
    for got, want in zip(_grads(split), _grads(ref)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in split.parameters()), \
        "W must not record its accumulation into .grad"
    assert set(finals.values()) == {1}, "each parameter's hooks run once, in B or in W"


@pytest.mark.parametrize("impl", ["torch", "peerline"])
def test_input_without_gradient(impl):
    """The first stage's data needs no gradient: the graph form runs the whole backward in W; the lean form runs
    all of it but the fused weight GEMMs in B."""
    seed = int(torch.randint(0, 1 << 30, ()))
    ref, split = _model(impl, seed), _model(impl, seed)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    ref(x).sum().backward()
    pending = SB.backward_input([split(x).sum()], [None], [x], list(split.parameters()))
    deferred = _fused_weights(split) if impl == "peerline" else {id(p) for p in split.parameters()}
    assert all((p.grad is None) == (id(p) in deferred) for p in split.parameters())
    SB.backward_weight(pending, list(split.parameters()))
    for got, want in zip(_grads(split), _grads(ref)):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_mostly_plain_weights_keep_the_graph_form():
    """Fused Linears holding under half the parameters (a wide plain head): the graph form, which defers every
    weight gradient to W."""
    seed = int(torch.randint(0, 1 << 30, ()))
    torch.manual_seed(seed)
    model = nn.Sequential(Block(8, "peerline"), nn.Linear(8, 64)).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    pending = SB.backward_input([model(x).sum()], [None], [x], list(model.parameters()))
    assert pending.groups and pending.roots
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("form", ["lean", "graph"])
def test_residual_norm_blocks_split_equal_one_backward(monkeypatch, form):
    """The residual-MLP block where its norm takes the kernels' path (stood in for on the CPU): the norm's backward
    node also yields the residual's gradient and fc2's bias gradient. Split into B and W, in either form (the graph
    form re-runs that node in W for the norm's and fc2's bias parameters), it equals one whole backward, and each
    parameter's post-accumulate hooks run once."""
    from peerline.distributed.model import ResidualMLPBlock
    from peerline.kernels import layer_norm as ln

    monkeypatch.setattr(ln, "fused_supported", lambda x, w, b: True)
    if form == "graph":
        monkeypatch.setattr(SB, "_lean", lambda by_node, in_graph: False)
    seed = int(torch.randint(0, 1 << 30, ()))

    def model():
        torch.manual_seed(seed)
        return nn.Sequential(ResidualMLPBlock(8, "peerline"), ResidualMLPBlock(8, "peerline")).double()

    ref, split = model(), model()
    for m in (ref, split):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    finals = {id(p): 0 for p in split.parameters()}
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: finals.__setitem__(id(p), finals[id(p)] + 1))
    x0, dy = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    xr, xs = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    ref(xr).backward(dy)
    pending = SB.backward_input([split(xs)], [dy], [xs], list(split.parameters()))
    assert bool(pending.groups) == (form == "graph") and len(pending.queue) == 4
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-12, atol=1e-12)
    SB.backward_weight(pending, list(split.parameters()))
    for (name, got), want in zip(split.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert set(finals.values()) == {1}, "each parameter's hooks run once, in B or in W"
