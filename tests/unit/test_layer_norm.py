"""The fused LayerNorm's contract on the CPU (kernels/layer_norm.py): the autograd Function the GPU runs, with torch's
native layer norm ops standing in for the kernels, against F.layer_norm in float64; the module is nn.LayerNorm to
its state; the backward formula the kernel implements; and the CUDA source builds for sm_90 with 16-byte accesses
and no spills. The kernels themselves are checked against float64 on a GPU (tests/gpu/test_layer_norm_gpu.py)."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.bench.kernel_tools import inspect_sass
from peerline.kernels import layer_norm as ln


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 24), (1, 1, 8), (3, 0, 16)])
def test_function_equals_layer_norm(shape):
    gen = _gen()
    width = shape[-1]
    x = torch.randn(*shape, dtype=torch.float64, generator=gen)
    w = torch.randn(width, dtype=torch.float64, generator=gen)
    b = torch.randn(width, dtype=torch.float64, generator=gen)
    dy = torch.randn(*shape, dtype=torch.float64, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref = F.layer_norm(leaves[0], (width,), leaves[1], leaves[2], 1e-5)
    ref.backward(dy)
    got_leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    got = ln.LayerNormFunction.apply(*got_leaves, 1e-5)
    got.backward(dy)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(got_leaves, leaves, strict=True):
        torch.testing.assert_close(g.grad, r.grad, rtol=1e-12, atol=1e-12)


def test_function_takes_a_strided_input_and_gradient():
    """A transposed (non-contiguous) input and gradient: the Function makes them rows of H itself."""
    gen = _gen()
    x = torch.randn(16, 6, dtype=torch.float64, generator=gen).t()  # [6, 16], strided
    w, b = torch.randn(16, dtype=torch.float64, generator=gen), torch.randn(16, dtype=torch.float64, generator=gen)
    dy = torch.randn(16, 6, dtype=torch.float64, generator=gen).t()
    a = x.clone().requires_grad_(True)
    F.layer_norm(a, (16,), w, b).backward(dy)
    c = x.clone().requires_grad_(True)
    ln.LayerNormFunction.apply(c, w, b, 1e-5).backward(dy)
    torch.testing.assert_close(c.grad, a.grad, rtol=1e-12, atol=1e-12)


def test_backward_formula_of_the_kernel():
    """dx = rstd (g dy - mean(g dy) - xhat mean(g dy xhat)); dg = sum dy xhat; db = sum dy (layer_norm.cu), in
    float64 against autograd."""
    gen = _gen()
    rows, width, eps = 9, 40, 1e-5
    x = torch.randn(rows, width, dtype=torch.float64, generator=gen) * 3 + 1
    g = torch.randn(width, dtype=torch.float64, generator=gen)
    b = torch.randn(width, dtype=torch.float64, generator=gen)
    dy = torch.randn(rows, width, dtype=torch.float64, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (x, g, b)]
    F.layer_norm(leaves[0], (width,), leaves[1], leaves[2], eps).backward(dy)
    mean = x.mean(-1, keepdim=True)
    rstd = ((x - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (x - mean) * rstd
    wdy = dy * g
    dx = (wdy - xhat * (wdy * xhat).mean(-1, keepdim=True) - wdy.mean(-1, keepdim=True)) * rstd
    torch.testing.assert_close(dx, leaves[0].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((dy * xhat).sum(0), leaves[1].grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dy.sum(0), leaves[2].grad, rtol=1e-10, atol=1e-12)


def test_module_is_layer_norm_to_its_state():
    torch.manual_seed(int(torch.randint(0, 1 << 30, ())))
    plain = nn.LayerNorm(32)
    with torch.no_grad():
        plain.weight.normal_()
        plain.bias.normal_()
    fused = ln.FusedLayerNorm(32, impl="peerline")
    assert isinstance(fused, nn.LayerNorm) and list(fused.state_dict()) == list(plain.state_dict())
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4, 32)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)  # the CPU runs torch's layer_norm


def test_which_tensors_the_kernels_take():
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    w = torch.empty(64, dtype=torch.bfloat16)
    assert not ln.fused_supported(x, w, w)  # the CPU
    meta = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    assert not ln.fused_supported(meta, w, w)  # not CUDA either
    assert [ln.vectors_for(n) for n in (8, 2048, 2056, 4096, 8192)] == [1, 1, 2, 2, 4]
    with pytest.raises(ValueError, match="at most 8192"):
        ln.vectors_for(8200)


NVCC = inspect_sass.find_tool("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_kernels_build_with_16_byte_accesses_and_no_spills(tmp_path):
    src = str(ln.KERNEL_SOURCE)
    ptx = inspect_sass.ptx_of(ln.KERNEL_SOURCE, NVCC)
    for v in ln.VECTORS:
        for name in (f"pl_ln_forward_{v}", f"pl_ln_backward_{v}"):
            body = inspect_sass.ptx_entry(ptx, name)
            assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body) and "st.global.v4.u32" in body, name
            assert not re.search(r"(ld|st)\.global(\.nc)?\.(u16|b16)", body), name
    r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "ln.cubin"), src],
                       check=True, capture_output=True, text=True, timeout=150)
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", r.stderr)
    assert len(props) == 2 * len(ln.VECTORS) + 1 and all(p == ("0", "0") for p in props), r.stderr


def test_auto_runs_torch_for_small_eager_launches_and_the_kernels_elsewhere(monkeypatch: pytest.MonkeyPatch):
    """--kernels auto: an eager launch below the card's "layer_norm" threshold runs torch's op (having loaded the
    kernels once, for a later capture), a launch at or above it and a captured launch from CAPTURED_TORCH_BELOW bytes
    on run the Function, and impl "peerline" always does. The device parts are stood in for: this checks the rule,
    not the kernels."""
    from peerline.kernels import card_table as ct
    from peerline.kernels import elementwise as ew

    width = 16
    threshold = 4 * 8 * width  # bytes: 8 rows in bf16 (read and written)
    monkeypatch.setattr(ew, "card_table", lambda index: ct.CardTable("NVIDIA H200",
                                                                     eager_torch_below={"layer_norm": threshold}))
    monkeypatch.setattr(ln, "_EAGER_CHOICE", {})
    monkeypatch.setattr(ln, "fused_supported", lambda x, w, b: True)
    loaded, ran = [], []
    monkeypatch.setattr(ln, "_kernel", lambda name, device: loaded.append(name))
    monkeypatch.setattr(ln.LayerNormFunction, "apply", lambda x, w, b, eps: ran.append(x.shape) or x * 0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    auto, pinned = ln.FusedLayerNorm(width, impl="auto"), ln.FusedLayerNorm(width, impl="peerline")
    small, large = torch.randn(7, width), torch.randn(2, 4, width)  # 7 rows below the threshold, 8 at it

    torch.testing.assert_close(auto(small), F.layer_norm(small, (width,), auto.weight, auto.bias), rtol=0, atol=0)
    assert ran == [] and loaded == ["pl_ln_forward_1", "pl_ln_backward_1", "pl_ln_reduce"]
    auto(small)
    assert ran == [] and len(loaded) == 3  # the choice and the loads happen once per size
    auto(large)
    assert ran == [large.shape]
    capturing[0] = True
    monkeypatch.setattr(ln, "CAPTURED_TORCH_BELOW", 4 * small.numel())
    auto(small)  # captured: the kernels from CAPTURED_TORCH_BELOW bytes on
    assert ran == [large.shape, small.shape]
    monkeypatch.setattr(ln, "CAPTURED_TORCH_BELOW", 4 * small.numel() + 4)
    torch.testing.assert_close(auto(small), F.layer_norm(small, (width,), auto.weight, auto.bias), rtol=0, atol=0)
    assert ran == [large.shape, small.shape]  # one element short of the captured threshold: torch's op
    capturing[0] = False
    pinned(small)
    assert ran == [large.shape, small.shape, small.shape]
    del loaded[:]
    auto(torch.randn(1, 2 * 8 * ln.THREADS))  # as many elements as another size, wider: its own kernels load
    auto(torch.randn(2, 8 * ln.THREADS))
    assert loaded == ["pl_ln_forward_2", "pl_ln_backward_2", "pl_ln_reduce",
                      "pl_ln_forward_1", "pl_ln_backward_1", "pl_ln_reduce"]


@pytest.mark.parametrize("kernels", ["torch", "auto", "peerline"])
def test_the_residual_mlp_block_norm_is_the_fused_layer_norm(kernels: str):
    """The default model's norm takes the kernels' path under the block's --kernels (on a GPU, for bf16), and keeps
    nn.LayerNorm's state: checkpoints name the same tensors, and on the CPU it computes torch's layer_norm."""
    from peerline.distributed.model import ResidualMLPBlock

    block = ResidualMLPBlock(16, kernels)
    assert isinstance(block.norm, ln.FusedLayerNorm) and block.norm.impl == kernels
    assert [k for k in block.state_dict() if k.startswith("norm.")] == ["norm.weight", "norm.bias"]
    x = torch.randn(2, 3, 16)
    want = F.layer_norm(x, (16,), block.norm.weight, block.norm.bias, block.norm.eps)
    torch.testing.assert_close(block.norm(x), want, rtol=0, atol=0)
