"""CPU checks of kernels/fused_linear.py: the in-place weight-gradient accumulation against nn.Linear autograd,
the post-accumulate-grad hooks, the per-iteration weight-cast cache, and the block against --kernels torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.model import ResidualMLPBlock
from peerline.kernels import fused_linear, ops
from peerline.kernels.fused_linear import FusedLinear

pytestmark = pytest.mark.timeout(60)


def _pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, FusedLinear]:
    torch.manual_seed(seed)
    ref = nn.Linear(24, 40, bias=bias)
    torch.manual_seed(seed)
    fused = FusedLinear(24, 40, bias=bias, impl="peerline")
    assert torch.equal(ref.weight, fused.weight)
    return ref, fused


@pytest.mark.parametrize("bias", [False, True])
def test_accumulated_grads_match_nn_linear(bias: bool) -> None:
    ref, fused = _pair(bias)
    for m in (ref, fused):  # pre-existing grads, as peerline's gradient syncs create them
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.25)
    ptr = fused.weight.grad.data_ptr()
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):  # microbatches accumulate
        x = torch.randn(3, 5, 24, generator=gen)
        dy = torch.randn(3, 5, 40, generator=gen)
        xr, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yr, yf = ref(xr), fused(xf)
        torch.testing.assert_close(yf, yr, rtol=1e-6, atol=1e-6)
        yr.backward(dy)
        yf.backward(dy)
        torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-6, atol=1e-6)
    assert fused.weight.grad.data_ptr() == ptr, "weight.grad was replaced instead of accumulated in place"
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused.weight.grad, torch.full_like(fused.weight, 0.25))
    if bias:
        torch.testing.assert_close(fused.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_missing_grad_is_created() -> None:
    ref, fused = _pair(True, seed=3)
    x = torch.randn(6, 24)
    ref(x).sum().backward()
    fused(x).sum().backward()
    assert fused.weight.grad is not None
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_post_accumulate_hooks_fire_once_per_backward() -> None:
    _, fused = _pair(True, seed=1)
    seen: list[tuple[str, torch.Tensor]] = []
    for name, p in fused.named_parameters():
        p.register_post_accumulate_grad_hook(lambda param, name=name: seen.append((name, param.grad.clone())))
    total = torch.zeros_like(fused.weight)
    for i in range(3):
        x = torch.randn(8, 24)
        fused(x).sum().backward()
        total += torch.ones(8, 40).T @ x
        names = sorted(n for n, _ in seen)
        assert names == ["bias"] * (i + 1) + ["weight"] * (i + 1), names
        # The hook sees the gradient already accumulated (final for this backward).
        torch.testing.assert_close([g for n, g in seen if n == "weight"][-1], total, rtol=1e-5, atol=1e-5)


def test_cpu_autocast_bf16_matches_nn_linear() -> None:
    ref, fused = _pair(True, seed=2)
    for m in (ref, fused):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(16, 24, generator=gen)
        dy = torch.randn(16, 40, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yr, yf = ref(x), fused(x)
        assert yf.dtype == yr.dtype == torch.bfloat16
        torch.testing.assert_close(yf, yr, rtol=2e-2, atol=2e-2)
        yr.backward(dy.bfloat16())
        yf.backward(dy.bfloat16())
    assert fused.weight.grad.dtype == torch.float32
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fused.bias.grad, ref.bias.grad, rtol=3e-2, atol=3e-2)


def test_cast_cache_once_per_iteration() -> None:
    _, fused = _pair(True, seed=4)
    cache = fused._cast_cache
    w1, _ = cache.get(fused.weight, fused.bias, torch.bfloat16)
    w2, _ = cache.get(fused.weight, fused.bias, torch.bfloat16)
    assert w1 is w2  # microbatches of one iteration share one copy
    fused_linear.new_iteration()
    w3, _ = cache.get(fused.weight, fused.bias, torch.bfloat16)
    assert w3 is not w1
    with torch.no_grad():
        fused.weight.add_(1.0)  # an optimizer step bumps the version: stale copy refreshed even without the hook
    w4, _ = cache.get(fused.weight, fused.bias, torch.bfloat16)
    assert w4 is not w3 and torch.equal(w4, fused.weight.detach().bfloat16())


def test_ops_linear_dispatch() -> None:
    _, fused = _pair(True, seed=5)
    x = torch.randn(4, 24)
    with torch.no_grad():  # no gradient: plain F.linear
        torch.testing.assert_close(ops.linear(x, fused.weight, fused.bias, "peerline"),
                                   nn.functional.linear(x, fused.weight, fused.bias))
    y = ops.linear(x, fused.weight, fused.bias, "peerline")
    assert type(y.grad_fn).__name__ == "_LinearAccumulateBackward"
    y = ops.linear(x, fused.weight, fused.bias, "torch")
    assert type(y.grad_fn).__name__ != "_LinearAccumulateBackward"
    assert not fused_linear.probe(torch.device("cpu"))


def test_auto_runs_plain_linear_for_eager_low_precision_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kernels auto on the CPU: bf16 weights already in the compute dtype, eager, run F.linear (torch's own node,
    the weight a leaf with its AccumulateGrad); fp32 weights, autocast to another dtype, a capture and impl
    "peerline" keep the fused Function. The gradients are nn.Linear's either way."""
    torch.manual_seed(int(torch.randint(0, 1 << 30, ())))
    w = torch.randn(40, 24, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 24, dtype=torch.bfloat16, requires_grad=True)
    fused_name = "_LinearAccumulateBackward"
    y = ops.linear(x, w, None, "auto")
    assert type(y.grad_fn).__name__ != fused_name
    y.float().square().sum().backward()
    ref_w, ref_x = w.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    nn.functional.linear(ref_x, ref_w).float().square().sum().backward()
    assert torch.equal(w.grad, ref_w.grad) and torch.equal(x.grad, ref_x.grad)
    assert type(ops.linear(x, w, None, "peerline").grad_fn).__name__ == fused_name
    w32 = torch.randn(40, 24, requires_grad=True)
    assert type(ops.linear(x.float(), w32, None, "auto").grad_fn).__name__ == fused_name
    with torch.autocast("cpu", dtype=torch.float16):  # the compute dtype differs from the weight's
        assert type(ops.linear(x, w, None, "auto").grad_fn).__name__ == fused_name
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not fused_linear.eager_plain(x, w)  # a captured forward keeps the fused path


def test_auto_runs_plain_linear_for_small_weights_when_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kernels auto, eager, fp32 weights under autocast: F.linear below the card's eager threshold for "linear"
    (by the fp32 weight's bytes), the fused Function at and above it, in a capture, and without autocast; bf16
    weights by their GEMM's multiply-adds per call. The pick is asked once per size. CUDA is mocked (the rule is for
    GPUs; the tensors stay on the CPU)."""
    from peerline.kernels import card_table as ct
    from peerline.kernels import elementwise as ew

    threshold = 4 * 40 * 24  # bytes: a [40, 24] fp32 weight sits exactly at it
    asked = []
    monkeypatch.setattr(ew, "card_table", lambda index: asked.append(index) or ct.CardTable(
        "NVIDIA H200", eager_torch_below={"linear": threshold}))
    monkeypatch.setattr(fused_linear, "_EAGER_SMALL", {})
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x = torch.randn(4, 24)
    small, at = torch.randn(39, 24, requires_grad=True), torch.randn(40, 24, requires_grad=True)
    assert not fused_linear.eager_plain(x, small)  # no autocast: the weights are the compute dtype's, fused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_linear.eager_plain(x, small)
        assert fused_linear.eager_plain(x, small)
        assert not fused_linear.eager_plain(x, at)
        capturing[0] = True
        assert not fused_linear.eager_plain(x, small)
    assert asked == [0, 0]  # once per size
    capturing[0] = False
    # bf16 weights in the compute dtype: by the GEMM's multiply-adds per call (rows x weight elements), with or
    # without autocast: the host is the bottleneck below EAGER_FUSED_MIN_MACS, the device at and above it
    monkeypatch.setattr(fused_linear, "EAGER_FUSED_MIN_MACS", 4 * 40 * 24)
    w16 = at.detach().bfloat16().requires_grad_(True)
    x16 = torch.randn(3, 24, dtype=torch.bfloat16)
    assert fused_linear.eager_plain(x16, w16) and not fused_linear.eager_plain(x16.repeat(2, 1)[:4], w16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_linear.eager_plain(torch.randn(2, 2, 24, dtype=torch.bfloat16), w16)
    assert asked == [0, 0]  # not the card's "linear" threshold
    capturing[0] = True
    assert not fused_linear.eager_plain(x16, w16)
    capturing[0] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.linear(x.requires_grad_(True), small, None, "auto")
        ref_w = small.detach().clone().requires_grad_(True)
        ref = nn.functional.linear(x.detach(), ref_w)
    assert type(y.grad_fn).__name__ != "_LinearAccumulateBackward"
    y.float().sum().backward()
    ref.float().sum().backward()
    assert torch.equal(y, ref) and torch.equal(small.grad, ref_w.grad)


def _train(kernels: str, iters: int = 3, microbatches: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(11)
    blocks = nn.Sequential(*[ResidualMLPBlock(16, kernels) for _ in range(2)])
    params = list(blocks.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for it in range(iters):
        fused_linear.new_iteration()
        for p in params:
            p.grad.zero_()
        total = 0.0
        for mb in range(microbatches):
            gen = torch.Generator().manual_seed(100 * it + mb)
            x = torch.randn(2, 5, 16, generator=gen)
            t = torch.randn(2, 5, 16, generator=gen)
            loss = nn.functional.mse_loss(blocks(x), t) / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, [p.detach().clone() for p in params]


def test_block_training_matches_torch_kernels() -> None:
    losses_t, params_t = _train("torch")
    losses_p, params_p = _train("peerline")
    assert losses_p == pytest.approx(losses_t, rel=1e-5, abs=1e-6)
    for a, b in zip(params_p, params_t):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert losses_t[-1] != losses_t[0]  # the run moved the weights


def test_input_without_grad_still_gives_weight_grad() -> None:
    ref, fused = _pair(False, seed=6)
    x = torch.randn(5, 24)  # plain data, no bias: the fused path would have nothing to run backward for
    ref(x).sum().backward()
    fused(x).sum().backward()
    torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("on_torch", [True, False])
def test_linear_bias_gelu_adds_the_bias_in_the_gemm_where_torch_runs_bias_gelu(monkeypatch: pytest.MonkeyPatch,
                                                                                on_torch: bool) -> None:
    """--kernels auto, eager on a GPU (mocked): where bias+GELU would run torch's ops, fc1's bias goes into the GEMM
    (no separate add node); elsewhere bias_gelu of the Linear's output. The values and every gradient
    equal gelu(x @ w.T + b) in float64 either way (fp64 weights take the fused-dW Function, bias included)."""
    from peerline.kernels import elementwise as ew

    asked = []
    monkeypatch.setattr(ew, "eager_bias_gelu_on_torch",
                        lambda dtype, bias_dtype, n, width, dev: asked.append((dtype, n, width)) or on_torch)
    monkeypatch.setattr(ops, "bias_gelu", lambda y, b, impl: nn.functional.gelu(y + b))  # the kernels' stand-in
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    fc1 = FusedLinear(6, 24, bias=False, impl="auto").double()
    bias = nn.Parameter(torch.randn(24, dtype=torch.float64, generator=gen))
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    y = ops.linear_bias_gelu(fc1, x, bias, "auto")
    assert asked == [(torch.float64, 2 * 5 * 24, 24)]
    names = set()
    stack = [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack.extend(f for f, _ in node.next_functions)
    assert ("AddBackward0" in names) is not on_torch  # the bias's own add only where bias_gelu runs (fp64: fused dW)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    y.backward(dy)
    w_ref, b_ref = fc1.weight.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = nn.functional.gelu(x_ref @ w_ref.T + b_ref)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for got, want in ((x.grad, x_ref.grad), (fc1.weight.grad, w_ref.grad), (bias.grad, b_ref.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="has a bias of its own"):
        FusedLinear(6, 24, impl="auto").with_bias(x, bias)
