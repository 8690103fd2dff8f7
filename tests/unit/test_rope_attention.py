"""The fused RoPE attention's contract on the CPU (kernels/rope.py): the same autograd Function the GPU runs, with
torch stand-ins for its two CUDA kernels and torch's CPU flash-attention ops, against the unfused reference
(view, rotate, scaled_dot_product_attention), outputs and input gradients in float64. The kernels themselves are
checked against float64 on a GPU (tests/gpu/test_rope_gpu.py)."""

import re

import pytest
import torch
from torch.nn.attention import SDPBackend

from peerline.bench.kernel_tools import inspect_sass
from peerline.kernels import rope
from peerline.models.rope import rope_tables


@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn-ops", "math"])
@pytest.mark.parametrize("batch,seq,heads,dim", [(2, 16, 4, 8), (1, 33, 2, 16), (3, 7, 1, 6)])
def test_fused_function_equals_reference(batch, seq, heads, dim, backend):
    """flash, cudnn-ops: an attention's ops called directly (CPU flash ops as stand-ins); math: the path of every
    SDPA backend other than those (SDPA on one backend, its backward by autograd on the graph the forward keeps) on
    torch's reference backend; auto: whichever torch's own choice leads to."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    cos, sin = (t.double() for t in rope_tables(seq + 5, dim))
    qkv = torch.randn(batch, seq, 3 * heads * dim, dtype=torch.float64, generator=gen)
    dy = torch.randn(batch, seq, heads * dim, dtype=torch.float64, generator=gen)
    ref_in = qkv.clone().requires_grad_(True)
    ref = rope.attention_reference(ref_in, cos, sin, heads)
    ref.backward(dy)
    fused_in = qkv.clone().requires_grad_(True)
    out = rope.FusedRopeAttention.apply(fused_in.clone(), cos, sin, heads, backend)  # it rotates its input
    out.backward(dy)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused_in.grad, ref_in.grad, rtol=1e-10, atol=1e-10)


def test_forward_rotates_q_and_k_in_place_and_leaves_v():
    batch, seq, heads, dim = 2, 9, 3, 8
    cos, sin = rope_tables(seq, dim)
    qkv5 = torch.randn(batch, seq, 3, heads, dim)
    before = qkv5.clone()
    rope.rope_forward_(qkv5, cos, sin)
    torch.testing.assert_close(qkv5[:, :, 2], before[:, :, 2], rtol=0, atol=0)
    for part in (0, 1):
        want = rope.apply_rope(before[:, :, part].transpose(1, 2), cos, sin).transpose(1, 2)
        torch.testing.assert_close(qkv5[:, :, part], want)


def test_backward_pack_is_the_transposed_rotation():
    """<R x, g> == <x, R^T g> for the rotation R of the forward and the backward's R^T, per position."""
    batch, seq, heads, dim = 1, 5, 2, 4
    cos, sin = (t.double() for t in rope_tables(seq, dim))
    x = torch.randn(batch, seq, 3, heads, dim, dtype=torch.float64)
    g = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    rotated = x.clone()
    rope.rope_forward_(rotated, cos, sin)
    packed = rope.rope_backward_pack(g, g, g, cos, sin)
    for part in (0, 1):
        lhs = (rotated[:, :, part].transpose(1, 2) * g).sum()
        rhs = (x[:, :, part] * packed[:, :, part]).sum()
        torch.testing.assert_close(lhs, rhs)
    torch.testing.assert_close(packed[:, :, 2], g.transpose(1, 2))


def test_dispatch_takes_the_reference_off_the_gpu():
    qkv = torch.randn(1, 4, 3 * 8, dtype=torch.bfloat16)
    assert not rope.fused_supported(qkv, 2)
    cos, sin = rope_tables(4, 4)
    torch.testing.assert_close(rope.rope_attention(qkv, cos, sin, 2, "peerline"),
                               rope.attention_reference(qkv, cos, sin, 2))


def test_attention_backend_is_checked(monkeypatch):
    monkeypatch.setenv("PEERLINE_ATTENTION", "cuDNN")
    assert rope.attention_backend() == "cudnn"
    monkeypatch.setenv("PEERLINE_ATTENTION", "fa3")
    with pytest.raises(ValueError, match="PEERLINE_ATTENTION='fa3' is not an attention backend; choose one of "
                                         "auto, flash"):
        rope.attention_backend()
    monkeypatch.delenv("PEERLINE_ATTENTION")
    assert rope.attention_backend() == "auto"


def test_auto_runs_the_backend_torch_would_pick(monkeypatch):
    """auto asks torch._fused_sdp_choice, with tensors that require grad, as the plain model's SDPA call would,
    once per shape."""
    monkeypatch.setattr(rope, "_AUTO_PICKS", {})
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    want = {SDPBackend.FLASH_ATTENTION: None, SDPBackend.CUDNN_ATTENTION: SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION: SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH: SDPBackend.MATH}
    native = int(torch._fused_sdp_choice(q, q, q, is_causal=True))
    assert rope.resolve_backend("auto", q, q, q) == want[SDPBackend(native)]
    asked = []
    for picked, expected in want.items():
        def fake(*args, picked=picked, **kwargs):
            asked.append((all(t.requires_grad for t in args[:3]), kwargs.get("is_causal")))
            return int(picked)
        monkeypatch.setattr(torch, "_fused_sdp_choice", fake)
        monkeypatch.setattr(rope, "_AUTO_PICKS", {})
        assert rope.resolve_backend("auto", q, q, q) == expected, picked
        assert rope.resolve_backend("auto", q, q, q) == expected, picked  # the same shape: from the cache
    assert asked == [(True, True)] * len(want)
    longer = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    rope.resolve_backend("auto", longer, longer, longer)
    assert len(asked) == len(want) + 1  # another shape asks again
    assert rope.resolve_backend("cudnn", q, q, q) == SDPBackend.CUDNN_ATTENTION
    assert rope.resolve_backend("flash", q, q, q) is None


@pytest.mark.parametrize("dim", [12, 4, 8 * rope._THREADS + 8])
def test_kernel_rejects_head_widths_its_vector_loads_cannot_take(dim):
    cos, sin = rope_tables(4, dim)
    with pytest.raises(ValueError, match="multiple of 8"):
        rope._check_kernel_shapes(dim, cos, sin)


def test_kernel_rejects_tables_it_cannot_read_as_fp32_vectors():
    cos, sin = rope_tables(8, 16)
    for bad in (cos.bfloat16(), cos.t().contiguous().t(), torch.empty(8 * 16 + 1)[1:].view(8, 16)):
        with pytest.raises(ValueError, match="cos table fp32, contiguous, 16-byte aligned"):
            rope._check_kernel_shapes(16, bad, sin)
    rope._check_kernel_shapes(16, cos, sin)


NVCC = inspect_sass.find_tool("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_kernels_build_with_vector_memory_access():
    """Both kernels compile for sm_90 and move bf16 as 8-byte words and the tables as 16-byte vectors (no 2-byte
    global loads or stores): the bandwidth the layout allows."""
    text = inspect_sass.ptx_of(rope.KERNEL_SOURCE, NVCC)
    for name in ("pl_rope_forward", "pl_rope_backward_pack"):
        body = inspect_sass.ptx_entry(text, name)
        assert re.search(r"ld\.global(\.nc)?\.v4\.f32", body), name
        assert re.search(r"ld\.global(\.nc)?\.v2\.u32", body) and "st.global.v2.u32" in body, name
        assert not re.search(r"(ld|st)\.global(\.nc)?\.(u16|b16)", body), name


@pytest.mark.parametrize("backend", ["flash", "cudnn-ops", "math"])
def test_fused_function_under_non_reentrant_recompute(backend):
    """--recompute wraps blocks in torch.utils.checkpoint (non-reentrant): both paths of the fused Function (flash's
    ops; an SDPA backend with the graph its forward keeps) give the reference's gradients when recomputed."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    batch, seq, heads, dim = 2, 12, 2, 8
    cos, sin = (t.double() for t in rope_tables(seq, dim))
    qkv = torch.randn(batch, seq, 3 * heads * dim, dtype=torch.float64, generator=gen)
    weight = torch.randn(3 * heads * dim, 3 * heads * dim, dtype=torch.float64, generator=gen) / 8
    dy = torch.randn(batch, seq, heads * dim, dtype=torch.float64, generator=gen)

    def block(x, fused):
        h = x @ weight  # a fresh qkv each call, as the block's Linear gives the Function
        return rope.FusedRopeAttention.apply(h, cos, sin, heads, backend) if fused else \
            rope.attention_reference(h, cos, sin, heads)

    ref_in = qkv.clone().requires_grad_(True)
    block(ref_in, False).backward(dy)
    got_in = qkv.clone().requires_grad_(True)
    out = checkpoint(block, got_in, True, use_reentrant=False)
    out.backward(dy)
    torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=1e-10, atol=1e-10)


def test_cudnn_ops_are_called_as_their_schemas_name_the_arguments(monkeypatch):
    """The cudnn-ops route's CUDA branch binds each argument to the parameter torch's schema names: the forward asks
    for the logsumexp, causal, no bias or dropout; the backward gets the forward's extras in their places. The ops
    are stood in for (no CUDA here), each call read back through its real schema."""
    calls = {}

    def fake(op_name, result):
        schema = getattr(torch.ops.aten, op_name).default._schema

        def op(*args, **kwargs):
            assert not kwargs and len(args) <= len(schema.arguments), (op_name, len(args))
            calls[op_name] = dict(zip((a.name for a in schema.arguments), args))
            return result
        return op

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    q, k, v, out, lse, dout = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(6))
    cq, ck, seed, offset = (torch.randn(1, generator=gen) for _ in range(4))
    grads = tuple(torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention",
                        fake("_scaled_dot_product_cudnn_attention", (out, lse, cq, ck, 8, 9, seed, offset, None)))
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward",
                        fake("_scaled_dot_product_cudnn_attention_backward", grads))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got, saved = rope._cudnn_forward(q, k, v)
    fwd = calls["_scaled_dot_product_cudnn_attention"]
    assert got is out and fwd["query"] is q and fwd["key"] is k and fwd["value"] is v
    assert fwd["attn_bias"] is None and fwd["compute_log_sumexp"] is True and fwd["dropout_p"] == 0.0
    assert fwd["is_causal"] is True and fwd["return_debug_mask"] is False
    assert rope._cudnn_backward(dout, q, k, v, out, saved) is grads
    bwd = calls["_scaled_dot_product_cudnn_attention_backward"]
    expected = {"grad_out": dout, "query": q, "key": k, "value": v, "out": out, "logsumexp": lse,
                "philox_seed": seed, "philox_offset": offset, "cum_seq_q": cq, "cum_seq_k": ck}
    assert all(bwd[name] is t for name, t in expected.items()), sorted(n for n, t in expected.items()
                                                                       if bwd[n] is not t)
    assert bwd["attn_bias"] is None and (bwd["max_q"], bwd["max_k"]) == (8, 9)
    assert bwd["dropout_p"] == 0.0 and bwd["is_causal"] is True
