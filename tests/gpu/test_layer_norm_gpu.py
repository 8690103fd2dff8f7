"""The fused LayerNorm kernels (kernels/layer_norm.cu) on a GPU against float64 torch: every register capacity,
widths that fill a block's threads and widths that do not, one row and many; repeatable to the bit; replayed from a
CUDA graph; and the module in a bf16 model (gradients reach the parameters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels import layer_norm as ln

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# (rows, width): 256 and 1536 leave threads idle; 2056 needs two vectors per thread with most threads holding one;
# 4096 rows of 2048 is the GPT compute shape's; 8192 the largest width (four vectors per thread).
SHAPES = [(1, 256), (7, 1536), (300, 2048), (4096, 2048), (33, 2056), (64, 4096), (16, 8192)]


def _inputs(rows: int, width: int) -> tuple[torch.Tensor, ...]:
    x = (torch.randn(rows, width, device="cuda") * 2 + 0.5).to(torch.bfloat16)
    w = (torch.randn(width, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    b = (torch.randn(width, device="cuda") * 0.1).to(torch.bfloat16)
    dy = torch.randn(rows, width, device="cuda").to(torch.bfloat16)
    return x, w, b, dy


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _fused(x, w, b, dy):
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ln.LayerNormFunction.apply(*leaves, 1e-5)
    y.backward(dy)
    return y.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize("rows,width", SHAPES)
def test_forward_and_backward_match_float64(rows: int, width: int) -> None:
    x, w, b, dy = _inputs(rows, width)
    leaves = [t.double().requires_grad_(True) for t in (x, w, b)]
    ref = F.layer_norm(leaves[0], (width,), leaves[1], leaves[2], 1e-5)
    ref.backward(dy.double())
    y, dx, dw, db = _fused(x, w, b, dy)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == torch.bfloat16
    assert _rel(y, ref) < 4e-3  # the bf16 rounding of the result (8 mantissa bits: ~2e-3)
    for got, want in ((dx, leaves[0].grad), (dw, leaves[1].grad), (db, leaves[2].grad)):
        assert torch.isfinite(got.float()).all()
        assert _rel(got, want) < 1e-2, (rows, width)


def test_repeatable_to_the_bit() -> None:
    x, w, b, dy = _inputs(4096, 2048)
    first, second = _fused(x, w, b, dy), _fused(x, w, b, dy)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


def test_graph_replay_equals_eager() -> None:
    """Forward and backward captured once, replayed on new inputs copied into the static ones."""
    rows, width = 512, 2048
    static = [t.clone() for t in _inputs(rows, width)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _fused(*static)  # compile and load the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _fused(*static)
    for _ in range(2):
        fresh = _inputs(rows, width)
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, _fused(*fresh), strict=True):
            assert torch.equal(got, want)


def test_module_in_a_bf16_model_matches_torch_layer_norm() -> None:
    norm = ln.FusedLayerNorm(2048, impl="peerline").cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
        norm.bias.normal_(0.0, 0.1)
    plain = torch.nn.LayerNorm(2048).cuda().to(torch.bfloat16)
    plain.load_state_dict(norm.state_dict())
    x = torch.randn(2, 512, 2048, device="cuda").to(torch.bfloat16)
    a, c = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    norm(a).float().square().mean().backward()
    plain(c).float().square().mean().backward()
    assert ln.fused_supported(a, norm.weight, norm.bias)
    for got, want in ((a.grad, c.grad), (norm.weight.grad, plain.weight.grad), (norm.bias.grad, plain.bias.grad)):
        assert got is not None and _rel(got, want.double()) < 2e-2


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("summed", [True, False])
def test_residual_backward_matches_float64(rows: int, width: int, summed: bool) -> None:
    """The residual kernels (pl_ln_backward_res[_sum]_V): dx is the LayerNorm's plus the residual gradient, and with
    sums the residual gradient's column sums come back, all against float64."""
    x, w, b, dy = _inputs(rows, width)
    dres = torch.randn(rows, width, device="cuda").to(torch.bfloat16)
    leaves = [t.double().requires_grad_(True) for t in (x, w, b)]
    F.layer_norm(leaves[0], (width,), leaves[1], leaves[2], 1e-5).backward(dy.double())
    _, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5)
    dx, dw, db, dsum = ln.layer_norm_backward(dy, x, w, b, mean, rstd, residual=dres, residual_sum=summed)
    assert (dsum is not None) == summed
    wants = [(dx, leaves[0].grad + dres.double()), (dw, leaves[1].grad), (db, leaves[2].grad)]
    if summed:
        wants.append((dsum, dres.double().sum(0)))
    for got, want in wants:
        assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
        assert _rel(got, want) < 1e-2, (rows, width)
    again = ln.layer_norm_backward(dy, x, w, b, mean, rstd, residual=dres, residual_sum=summed)
    for a, c in zip((dx, dw, db, dsum), again, strict=True):
        assert (a is None and c is None) or torch.equal(a, c)  # repeatable to the bit


@pytest.mark.parametrize("block_kind", ["mlp", "gpt"])
def test_blocks_with_the_residual_norm_match_torch_ops_in_bf16(block_kind: str) -> None:
    """The residual-MLP and GPT blocks on bf16 with peerline's kernels (the norms' residual backward, fc2's bias
    gradient from it) against the same blocks in torch's ops: output, input gradient and every parameter's
    gradient, relative to the bf16 rounding."""
    from peerline.distributed.model import ResidualMLPBlock
    from peerline.models.gpt import GPTBlock

    def make(kernels: str) -> torch.nn.Module:
        block = ResidualMLPBlock(1024, kernels) if block_kind == "mlp" else GPTBlock(1024, 8, kernels, max_seq=256)
        block.cuda()
        for p in block.parameters():  # bf16 parameters, fp32 buffers (the RoPE tables), as apply_precision casts
            p.data = p.data.to(torch.bfloat16)
        return block

    fused, plain = make("peerline"), make("torch")
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(0.0, 0.05).add_(1.0 if p.dim() == 1 and p.shape[0] == 1024 else 0.0)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(4, 256, 1024, device="cuda").to(torch.bfloat16)
    dy = torch.randn_like(x)
    assert fused.norm.takes_kernels(x) if block_kind == "mlp" else fused.norm2.takes_kernels(x)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [fused(xs[0]), plain(xs[1])]
    for out in outs:
        out.backward(dy)
    assert _rel(outs[0], outs[1].double()) < 2e-2
    assert _rel(xs[0].grad, xs[1].grad.double()) < 2e-2
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
        assert _rel(p.grad, q.grad.double()) < 3e-2, name
