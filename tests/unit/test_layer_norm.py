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
        for name in (f"pl_ln_forward_{v}", f"pl_ln_backward_{v}", f"pl_ln_backward_res_{v}",
                     f"pl_ln_backward_res_sum_{v}"):
            body = inspect_sass.ptx_entry(ptx, name)
            assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body) and "st.global.v4.u32" in body, name
            assert not re.search(r"(ld|st)\.global(\.nc)?\.(u16|b16)", body), name
    r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "ln.cubin"), src],
                       check=True, capture_output=True, text=True, timeout=150)
    props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", r.stderr)
    assert len(props) == 4 * len(ln.VECTORS) + 2 and all(p == ("0", "0") for p in props), r.stderr


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
    assert ran == [] and loaded == ln.kernel_names(width)
    auto(small)
    assert ran == [] and len(loaded) == len(ln.kernel_names(width))  # the choice and loads happen once per size
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
    assert loaded == ln.kernel_names(2 * 8 * ln.THREADS) + ln.kernel_names(8 * ln.THREADS)
    assert "pl_ln_backward_res_sum_2" in ln.kernel_names(2 * 8 * ln.THREADS)


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


@pytest.mark.parametrize("shape,out_bias", [((2, 5, 16), True), ((7, 24), False), ((3, 0, 16), True)])
def test_residual_function_equals_layer_norm_and_the_residual_add(shape, out_bias: bool):
    """ResidualLayerNormFunction (the CPU's stand-ins for the residual kernels) in float64: y = x + f(norm(x)) with
    f a Linear whose bias is outside autograd there, against the same block in torch's ops; x's gradient (the
    residual's added in the LayerNorm's pass), the norm's and the Linear's bias gradient (the residual gradient's
    column sums) all equal."""
    gen = _gen()
    width = shape[-1]
    x, dy = (torch.randn(*shape, dtype=torch.float64, generator=gen) for _ in range(2))
    w, b, bias2 = (torch.randn(width, dtype=torch.float64, generator=gen) for _ in range(3))
    w2 = torch.randn(width, width, dtype=torch.float64, generator=gen)

    def leaves():
        return [t.clone().requires_grad_(True) for t in (x, w, b, bias2)]

    ref = leaves()
    (ref[0] + F.linear(torch.tanh(F.layer_norm(ref[0], (width,), ref[1], ref[2], 1e-5)), w2, ref[3])).backward(dy)
    got = leaves()
    n, residual = ln.ResidualLayerNormFunction.apply(*got[:3], 1e-5, got[3] if out_bias else None)
    assert residual.shape == x.shape and residual.data_ptr() == got[0].data_ptr()  # x itself, viewed
    out = F.linear(torch.tanh(n), w2, got[3].detach() if out_bias else got[3])
    (residual + out).backward(dy)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.grad, r.grad, rtol=1e-12, atol=1e-12)


def test_residual_function_adds_in_the_bf16_rounding_once():
    """On bf16 tensors dx is float64's x gradient plus the residual's within bf16 rounding: the kernel rounds once,
    the CPU stand-in twice (torch's bf16 dx, then the sum), so the bound is two bf16 steps of the largest element
    (2^-6). The column sums are the residual's."""
    gen = _gen()
    x, dy, dres = (torch.randn(64, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    w, b = torch.ones(32, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)
    _, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5)
    dx, _, _, summed = ln.layer_norm_backward(dy, x, w, b, mean, rstd, residual=dres, residual_sum=True)
    leaf = x.double().requires_grad_(True)
    F.layer_norm(leaf, (32,), w.double(), b.double(), 1e-5).backward(dy.double())
    want = leaf.grad + dres.double()
    assert dx.dtype == summed.dtype == torch.bfloat16
    assert (dx.double() - want).abs().max() <= 2 ** -6 * want.abs().max()  # two bf16 steps of the largest
    torch.testing.assert_close(summed.double(), dres.double().sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("block_kind", ["mlp", "gpt"])
def test_blocks_with_the_residual_norm_match_torch_ops(monkeypatch: pytest.MonkeyPatch, block_kind: str):
    """The residual-MLP and GPT blocks where their norms take the kernels' path (stood in for on the CPU: on a GPU
    the bf16 kernels, tests/gpu/test_layer_norm_gpu.py): the residual's gradient and fc2's bias gradient come from
    the norm's backward, fc2 sums nothing; output, input gradient and every parameter's gradient equal the blocks
    in torch's ops (float64)."""
    from peerline.distributed.model import ResidualMLPBlock
    from peerline.models.gpt import GPTBlock

    monkeypatch.setattr(ln, "fused_supported", lambda x, w, b: True)
    ran = []
    backward = ln.layer_norm_backward
    monkeypatch.setattr(ln, "layer_norm_backward", lambda *a, **k: ran.append(
        (k.get("residual") is not None, k.get("residual_sum"))) or backward(*a, **k))

    def make(kernels: str) -> nn.Module:
        torch.manual_seed(3)
        block = ResidualMLPBlock(16, kernels) if block_kind == "mlp" else GPTBlock(16, 4, kernels, max_seq=8)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(generator=gen)
        return block.double()

    gen = _gen()
    state = make("torch").state_dict()
    fused, plain = make("peerline"), make("torch")
    fused.load_state_dict(state)
    plain.load_state_dict(state)
    x, dy = (torch.randn(2, 8, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [fused(xs[0]), plain(xs[1])]
    for out in outs:
        out.backward(dy)
    want = [(True, True)] if block_kind == "mlp" else [(True, True), (True, False)]
    assert ran == want  # the norms took the residual path (the GPT's attention branch has no bias to sum)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
