"""kernels/fused_linear.py on a GPU: the addmm.dtype_out probe, bf16-autocast gradients over accumulated microbatches
against a float64 reference of the same math, the post-accumulate hooks, and a captured CUDA graph whose replays
equal eager runs (also after the weights change between replays: the weight cast must be inside the graph).
Skipped without CUDA. Run: python3 -m pytest -q -m gpu tests/gpu/test_fused_linear_gpu.py"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.model import ResidualMLPBlock
from peerline.kernels import fused_linear
from peerline.kernels.fused_linear import FusedLinear

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
IN, OUT, TOKENS, M = 512, 1536, 1024, 3


def _module(bias: bool, seed: int) -> FusedLinear:
    torch.manual_seed(seed)
    m = FusedLinear(IN, OUT, bias=bias, impl="peerline").to(DEV)
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 0.1  # grads already there and not zero: accumulation must keep them
    return m


def _data(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    xs = [torch.randn(2, TOKENS // 2, IN, device=DEV, generator=gen) for _ in range(M)]
    dys = [torch.randn(2, TOKENS // 2, OUT, device=DEV, generator=gen).bfloat16() for _ in range(M)]
    return xs, dys


def test_dtype_out_probe() -> None:
    """The fast path: aten::addmm.dtype_out accumulating bf16 products into an fp32 tensor in place. A failure here
    means the fallback (one more GEMM output and add per microbatch) runs: correct, not faster."""
    assert fused_linear.probe(DEV), "addmm.dtype_out unusable on this torch/GPU: the slower fallback is in use"


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_grads_vs_float64(bias: bool) -> None:
    m = _module(bias, seed=1)
    g0 = {n: p.grad.detach().double().clone() for n, p in m.named_parameters()}
    ptr = m.weight.grad.data_ptr()
    fires = []
    m.weight.register_post_accumulate_grad_hook(lambda p: fires.append(1))
    xs, dys = _data(2)
    fused_linear.new_iteration()
    dxs = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.backward(dy)
        dxs.append(x.grad)
    assert len(fires) == M, f"post-accumulate hook fired {len(fires)} times for {M} backwards"
    assert m.weight.grad.data_ptr() == ptr and m.weight.grad.dtype == torch.float32
    # float64 reference of the same math: bf16 operands, exact products and sums.
    w16 = m.weight.detach().bfloat16().double()
    want_w = g0["weight"].clone()
    for x, dy, dx in zip(xs, dys, dxs):
        x16 = x.bfloat16().double().reshape(-1, IN)
        dy64 = dy.double().reshape(-1, OUT)
        want_w += dy64.T @ x16
        torch.testing.assert_close(dx.double().reshape(-1, IN), dy64 @ w16, rtol=1.6e-2, atol=1e-2)
    err = (m.weight.grad.double() - want_w).abs().max().item()
    scale = want_w.abs().max().item()
    # fp32 accumulation (the dtype_out path) stays near fp32 rounding; the fallback rounds each microbatch's dW
    # to bf16 first (as nn.Linear under autocast does), about 2**-9 relative.
    rel = 1e-4 if fused_linear.probe(DEV) else 1e-2
    assert err <= rel * scale + 1e-3, f"dW max error {err:.3g} (scale {scale:.3g}, allowed {rel:g} relative)"
    if bias:
        want_b = g0["bias"] + sum(dy.double().reshape(-1, OUT).sum(0) for dy in dys)
        torch.testing.assert_close(m.bias.grad.double(), want_b, rtol=1e-5, atol=1e-3)


def test_block_matches_nn_linear_under_autocast() -> None:
    """The block with fused fc1/fc2 against the same block with nn.Linear (the torch elementwise ops in both, so
    only the linear path differs), 3 microbatches of bf16 autocast."""
    blocks = []
    for impl in ("torch", "peerline"):
        torch.manual_seed(5)
        b = ResidualMLPBlock(IN, "torch").to(DEV)
        b.fc1.impl = b.fc2.impl = impl
        for p in b.parameters():
            p.grad = torch.zeros_like(p)
        blocks.append(b)
    gen = torch.Generator(device=DEV).manual_seed(6)
    fused_linear.new_iteration()
    for _ in range(M):
        x = torch.randn(2, 256, IN, device=DEV, generator=gen)
        dy = torch.randn(2, 256, IN, device=DEV, generator=gen)
        for b in blocks:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = b(x)
            y.float().backward(dy)
    for (name, p_ref), p_fused in zip(blocks[0].named_parameters(), blocks[1].parameters()):
        scale = p_ref.grad.abs().max().item()
        err = (p_fused.grad - p_ref.grad).abs().max().item()
        assert err <= 2e-2 * scale + 1e-5, f"{name}: grad max error {err:.3g} (scale {scale:.3g})"


def _iteration(m: FusedLinear, xs: list[torch.Tensor], dys: list[torch.Tensor]) -> None:
    fused_linear.new_iteration()  # host side: during capture it makes the cast part of the graph
    for p in m.parameters():
        p.grad.zero_()
    for x, dy in zip(xs, dys):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.backward(dy)


def test_graph_replay_equals_eager() -> None:
    m = _module(True, seed=3)
    xs, dys = _data(4)
    # Plain inputs (the bias makes the backward run); dx inside a capture is covered by the block test below.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream (as torch's graph docs ask); probes, too
        for _ in range(2):
            _iteration(m, xs, dys)
    torch.cuda.current_stream().wait_stream(side)
    ptrs = [p.grad.data_ptr() for p in m.parameters()]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _iteration(m, xs, dys)
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs, "capture replaced a .grad"

    new_x, new_dy = _data(7)
    for step in range(2):
        for x, nx in zip(xs, new_x):
            x.copy_(nx * (step + 1))
        for dy, ndy in zip(dys, new_dy):
            dy.copy_(ndy)
        for p in m.parameters():
            p.grad.fill_(float("nan"))  # poisoned: the replay must zero and refill them
        graph.replay()
        torch.cuda.synchronize()
        replayed = [p.grad.clone() for p in m.parameters()]
        _iteration(m, xs, dys)  # eager, same weights and data
        torch.cuda.synchronize()
        for got, want in zip(replayed, (p.grad for p in m.parameters())):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # an optimizer-like in-place update: the next replay must recast the weights
            m.weight.mul_(0.5).add_(0.01)
            m.bias.add_(0.1)


def test_block_training_steps_capture() -> None:
    """A two-block stack, three microbatches, AdamW (capturable): a captured iteration replayed 3 times gives the
    same parameters as 3 eager iterations from the same start."""
    def build() -> tuple[nn.Sequential, torch.optim.Optimizer]:
        torch.manual_seed(8)
        model = nn.Sequential(*[ResidualMLPBlock(256, "torch") for _ in range(2)]).to(DEV)
        for blk in model:
            blk.fc1.impl = blk.fc2.impl = "peerline"
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

    gen = torch.Generator(device=DEV).manual_seed(9)
    xs = [torch.randn(2, 128, 256, device=DEV, generator=gen) for _ in range(M)]
    ts = [torch.randn(2, 128, 256, device=DEV, generator=gen) for _ in range(M)]

    def iteration(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
        fused_linear.new_iteration()
        for p in model.parameters():
            p.grad.zero_()
        for x, t in zip(xs, ts):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            (nn.functional.mse_loss(y.float(), t) / M).backward()
        opt.step()

    eager, opt_e = build()
    graphed, opt_g = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        iteration(eager, opt_e)
        iteration(graphed, opt_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(graphed, opt_g)  # captured: the second iteration
    for _ in range(3):  # the capture itself ran no work: 1 warm-up + 3 replays = 1 warm-up + 3 eager iterations
        iteration(eager, opt_e)
        graph.replay()
    torch.cuda.synchronize()
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.parametrize("recipe", ["autocast", "bf16"])
@pytest.mark.parametrize("hidden", [512, 2048])
def test_eager_auto_block_matches_float64(recipe: str, hidden: int) -> None:
    """--kernels auto in an eager iteration (inside `eager_only()`, as the runtime runs one), fp32 weights under
    bf16 autocast and bf16 weights: the block's output and every gradient against a float64 run of the same weights
    and inputs (each recipe's own rounding allowed: bf16 operands, fp32 accumulation). The widths straddle the
    eager rules (plain F.linear below the card's "linear" threshold for fp32 weights and below
    EAGER_FUSED_MIN_MACS for bf16 ones, fc1's bias in the GEMM where bias+GELU runs torch's ops), so whichever paths
    this card's table picks are the ones checked."""
    from peerline.kernels.capture_state import eager_only

    torch.manual_seed(hidden)
    block = ResidualMLPBlock(hidden, "auto").to(DEV)
    if recipe == "bf16":
        block = block.bfloat16()
    ref = ResidualMLPBlock(hidden, "torch").to(DEV).double()
    ref.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    gen = torch.Generator(device=DEV).manual_seed(hidden + 1)
    fused_linear.new_iteration()
    dtype = torch.float32 if recipe == "autocast" else torch.bfloat16
    # h2048 at the MLP compute shape's 4096 rows: fc1's GEMM is 2^36 multiply-adds, the bf16 weights' fused path
    rows = (8, 512) if hidden == 2048 else (2, 128)
    for _ in range(M):  # accumulated microbatches, as a pipeline iteration runs them
        x = torch.randn(*rows, hidden, device=DEV, generator=gen, dtype=dtype).requires_grad_(True)
        dy = torch.randn(*rows, hidden, device=DEV, generator=gen, dtype=dtype)
        with eager_only(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=recipe == "autocast"):
            y = block(x)
            plain = fused_linear.eager_plain(x, block.fc1.weight)
        if recipe == "bf16":
            assert plain == (hidden < 2048), (hidden, plain)
        y.backward(dy.to(y.dtype))
        x64 = x.detach().double().requires_grad_(True)
        y64 = ref(x64)
        y64.backward(dy.double())
        scale = y64.abs().max().item()
        err = (y.double() - y64).abs().max().item()
        assert err <= 3e-2 * scale, f"output max error {err:.3g} (scale {scale:.3g})"
        err = (x.grad.double() - x64.grad).abs().max().item()
        assert err <= 3e-2 * x64.grad.abs().max().item(), f"input grad max error {err:.3g}"
    for (name, p64), p in zip(ref.named_parameters(), block.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        scale = p64.grad.abs().max().item()
        err = (p.grad.double() - p64.grad).abs().max().item()
        assert err <= 3e-2 * scale + 1e-6, f"{name}: grad max error {err:.3g} (scale {scale:.3g}, {recipe})"


@pytest.mark.parametrize("recipe", ["autocast", "bf16"])
@pytest.mark.parametrize("hidden", [512, 1024, 2048])
def test_eager_auto_block_direct_ops_equal_the_per_op_path(monkeypatch: pytest.MonkeyPatch, recipe: str,
                                                           hidden: int) -> None:
    """Where ops.mlp_block_on_torch lets an eager auto block call torch's ops directly (forward_torch_ops), the
    output and every gradient equal, bit for bit, the per-op path's (the same block with the decision forced off),
    over accumulated microbatches. The eager suite's shapes (h512 and h1024 bf16) must take the direct path on a
    card whose table sends their eager ops to torch (the H200's and H100's do)."""
    from peerline.kernels import ops
    from peerline.kernels.capture_state import eager_only

    torch.manual_seed(hidden)
    block = ResidualMLPBlock(hidden, "auto").to(DEV)
    if recipe == "bf16":
        block = block.bfloat16()
    dtype = torch.float32 if recipe == "autocast" else torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(hidden + 7)
    xs = [torch.randn(4, 512, hidden, device=DEV, generator=gen, dtype=dtype) for _ in range(M)]
    dys = [torch.randn(4, 512, hidden, device=DEV, generator=gen, dtype=dtype) for _ in range(M)]
    taken: list[bool] = []
    decide = ops.mlp_block_on_torch

    def run(direct: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(ops, "mlp_block_on_torch",
                            lambda *a: taken.append(decide(*a)) or taken[-1] if direct else False)
        block.zero_grad(set_to_none=True)
        fused_linear.new_iteration()
        out = []
        for x, dy in zip(xs, dys):
            x = x.clone().requires_grad_(True)
            with eager_only(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=recipe == "autocast"):
                y = block(x)
            y.backward(dy.to(y.dtype))
            out += [y.detach(), x.grad]
        return out + [p.grad for p in block.parameters()]

    direct = run(True)
    if not any(taken):
        if recipe == "bf16" and hidden <= 1024 and torch.cuda.get_device_name() in ("NVIDIA H200",
                                                                                    "NVIDIA H100 80GB HBM3"):
            pytest.fail("the eager suite's bf16 shape did not take the direct path on this card")
        pytest.skip("this card's table keeps a peerline kernel for this shape: the per-op path is the only one")
    per_op = run(False)
    assert len(direct) == len(per_op) == 2 * M + 6
    for i, (a, b) in enumerate(zip(direct, per_op)):
        assert a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"
