"""The fused RoPE attention's kernels (kernels/rope.cu) against float64 torch on a GPU, and the fused Function
against the unfused bf16 path: fresh random inputs each run, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from peerline.kernels import rope
from peerline.models.rope import rope_tables

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# (4, 4096, 16, 128): more rows than the grid's blocks take at once (the kernels' grid-stride loop); head width 96:
# 12 threads a row, 21 rows a block, 4 threads idle.
SHAPES = [(2, 128, 4, 64), (1, 2048, 16, 128), (3, 77, 6, 32), (1, 256, 2, 256), (4, 4096, 16, 128), (2, 100, 3, 96)]


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated in float64 (the reference the bf16 kernel is held to)."""
    seq = x.shape[-2]
    first, second = x.double().chunk(2, dim=-1)
    return x.double() * cos[:seq].double() + torch.cat([-second, first], dim=-1) * sin[:seq].double()


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_kernel_matches_float64(shape) -> None:
    batch, seq, heads, dim = shape
    cos, sin = (t.cuda() for t in rope_tables(seq, dim))
    qkv5 = torch.randn(batch, seq, 3, heads, dim, device="cuda").to(torch.bfloat16)
    before = qkv5.clone()
    rope.rope_forward_(qkv5, cos, sin)
    torch.cuda.synchronize()
    assert torch.equal(qkv5[:, :, 2], before[:, :, 2]), "v must be untouched"
    for part in (0, 1):
        want = _rotate64(before[:, :, part].transpose(1, 2), cos, sin).transpose(1, 2)
        got = qkv5[:, :, part].double()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 4e-3, (part, err)  # bf16 rounding of the result only (8 mantissa bits: ~2e-3)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_pack_matches_float64(shape) -> None:
    batch, seq, heads, dim = shape
    cos, sin = (t.cuda() for t in rope_tables(seq, dim))
    grads = [torch.randn(batch, seq, heads, dim, device="cuda").to(torch.bfloat16).transpose(1, 2) for _ in range(3)]
    packed = rope.rope_backward_pack(*grads, cos, sin)  # freshly allocated: poison-free check below is NaN-free
    torch.cuda.synchronize()
    assert packed.shape == (batch, seq, 3, heads, dim) and packed.is_contiguous()
    assert torch.isfinite(packed.float()).all()
    for part in (0, 1):
        want = _rotate64(grads[part], cos, -sin).transpose(1, 2)
        err = ((packed[:, :, part].double() - want).norm() / want.norm()).item()
        assert err < 4e-3, (part, err)
    assert torch.equal(packed[:, :, 2], grads[2].transpose(1, 2))


def test_backward_pack_writes_every_element() -> None:
    """The kernel writes into a NaN-poisoned buffer: every element must be overwritten."""
    batch, seq, heads, dim = 2, 64, 3, 64
    cos, sin = (t.cuda() for t in rope_tables(seq, dim))
    grads = [torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    poisoned = torch.full((batch, seq, 3, heads, dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = rope.rope_backward_pack(*grads, cos, sin, out=poisoned)
    torch.cuda.synchronize()
    assert got.data_ptr() == poisoned.data_ptr() and torch.isfinite(got.float()).all()


@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn", "cudnn-ops"])
@pytest.mark.parametrize("shape", [(2, 128, 4, 64), (1, 1024, 8, 128)])
def test_fused_attention_matches_unfused(shape, backend, monkeypatch) -> None:
    """Every PEERLINE_ATTENTION backend of the fused path against float64 (auto: the one torch picks here, printed
    in the log)."""
    monkeypatch.setenv("PEERLINE_ATTENTION", backend)
    batch, seq, heads, dim = shape
    cos, sin = (t.cuda() for t in rope_tables(seq, dim))
    qkv = torch.randn(batch, seq, 3 * heads * dim, device="cuda").to(torch.bfloat16)
    dy = torch.randn(batch, seq, heads * dim, device="cuda").to(torch.bfloat16)
    ref_in = qkv.double().requires_grad_(True)  # float64 reference: math attention on the CPU-exact formula
    ref = rope.attention_reference(ref_in, cos.double(), sin.double(), heads)
    ref.backward(dy.double())
    fused_in = qkv.clone().requires_grad_(True)
    assert rope.fused_supported(qkv, heads)
    out = rope.rope_attention(fused_in.clone(), cos, sin, heads, "peerline")
    out.backward(dy)
    for got, want in ((out, ref), (fused_in.grad, ref_in.grad)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 2e-2, err
