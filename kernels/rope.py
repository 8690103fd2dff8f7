"""Causal self-attention of a packed qkv with the rotary embedding fused in (Transformer Engine's fused RoPE on the
packed layout; torch's flash-attention ops for the attention itself).

  forward   one kernel rotates q and k in place inside the packed qkv [B, T, 3, heads, D] (bf16 in and out, fp32
            math), then flash attention reads q, k, v as strided views of it: no copies, no fp32 temporaries
  backward  flash attention's backward gives dq, dk, dv; one kernel applies the transposed rotation to dq and dk
            and writes them with dv into one packed dqkv (the concatenation the unfused path runs is this kernel)

The rotation (rotate-half pairs, tables from models/rope.py):  a' = a c - b s,  b' = b c + a s.
`rope_attention` takes this path for CUDA bf16 tensors that flash attention accepts, and the unfused reference
(`attention_reference`) everywhere else: fp32 runs, the CPU, --kernels torch. On the CPU the same Function runs
with torch stand-ins for both kernels and the CPU flash-attention ops, so CI checks its autograd contract.

The attention between the two rotations is, by default (PEERLINE_ATTENTION=auto), the backend torch's own
scaled_dot_product_attention picks for these q, k, v (torch._fused_sdp_choice): the same kernels a plain torch model
runs on this build and card (torch's sdp_utils puts cuDNN first on sm90 and sm100 once its bundled cuDNN is
recent enough). Flash and cuDNN run their attention's aten ops directly (no kept graph, no nested autograd call in
the backward: less host time per microbatch); any other backend runs through SDPA restricted to it, its backward by
autograd on a graph the forward keeps. PEERLINE_ATTENTION=flash or cudnn-ops forces one of the direct routes,
cudnn forces cuDNN through SDPA, and math is torch's reference backend (what the CPU tests run). On the CPU the flash
stand-ins take the direct routes' place, so the CPU tests check the Function's contract and
tests/gpu/test_rope_gpu.py checks the ops.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peerline import overrides

KERNEL_SOURCE = Path(__file__).resolve().parent / "rope.cu"
_THREADS = 256
_MAX_BLOCKS = 8192
_SAVED = object()  # marks where a saved tensor goes back among an attention op's extras
#: PEERLINE_ATTENTION -> the SDPA backend the fused path runs through (None: flash attention's ops directly;
#: "auto" is resolved per call by `resolve_backend`)
BACKENDS: dict[str, SDPBackend | None] = {"auto": None, "flash": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
                                          "cudnn-ops": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
#: PEERLINE_ATTENTION names whose backend runs through its aten ops directly rather than SDPA and nested autograd
DIRECT_OPS = frozenset({"cudnn-ops"})
#: torch._fused_sdp_choice's answer (an SDPBackend value) -> a BACKENDS name, or the backend itself
_TORCH_CHOICE: dict[int, str | SDPBackend] = {int(SDPBackend.FLASH_ATTENTION): "flash",
                                               int(SDPBackend.CUDNN_ATTENTION): "cudnn",
                                               int(SDPBackend.MATH): "math",
                                               int(SDPBackend.EFFICIENT_ATTENTION): SDPBackend.EFFICIENT_ATTENTION}


def attention_backend() -> str:
    """PEERLINE_ATTENTION (default auto); ValueError naming the choices for anything else."""
    name = overrides.get_str("PEERLINE_ATTENTION", "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"environment variable PEERLINE_ATTENTION={name!r} is not an attention backend; choose "
                         f"one of {', '.join(BACKENDS)}")
    return name


# (shape, strides, dtype, device) of q -> torch's pick for "auto": one host-side query per shape, not per call
_AUTO_PICKS: dict[tuple, SDPBackend | None] = {}


def resolve_backend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> SDPBackend | None:
    """The SDPA backend the fused path runs for `name` (None: flash attention's ops directly). "auto" asks torch
    which backend its own causal SDPA would pick for these tensors (a host-side check, no device work), once per
    shape: the views of a packed qkv of one shape have one set of strides."""
    if name != "auto":
        return BACKENDS[name]
    key = (q.shape, q.stride(), q.dtype, q.device)
    if key not in _AUTO_PICKS:
        # Asked as the plain model asks: with tensors that require grad (some backends' limits are training-only).
        leaves = (t.detach().requires_grad_(True) for t in (q, k, v))
        choice = _TORCH_CHOICE.get(int(torch._fused_sdp_choice(*leaves, is_causal=True)), "flash")
        _AUTO_PICKS[key] = BACKENDS[choice] if isinstance(choice, str) else choice
    return _AUTO_PICKS[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] rotated by the first T rows of the tables; computed in fp32 (fp64 for fp64 x), returned in x's
    dtype (the reference the kernels match)."""
    seq = x.shape[-2]
    cos, sin = cos[:seq], sin[:seq]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def attention_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [B, T, 3H] -> causal attention with RoPE on q and k, [B, T, H]: the unfused path."""
    batch, seq, three_h = qkv.shape
    q, k, v = qkv.view(batch, seq, 3, heads, three_h // (3 * heads)).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
    return y.transpose(1, 2).reshape(batch, seq, three_h // 3)


# ---- the two rotations: CUDA kernels, torch stand-ins on the CPU ----

def _grid(rows: int, dim: int) -> int:
    """Blocks for `rows` rows of head width `dim`: each thread takes four pairs, a block _THREADS // (dim // 8)
    rows per step (rope.cu)."""
    per_block = _THREADS // (dim // 8)
    return max(1, min(-(-rows // per_block), _MAX_BLOCKS))


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def _check_kernel_shapes(dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """What rope.cu's vector loads assume: D % 8 == 0 and at most 8 * _THREADS, fp32 tables contiguous and 16-byte
    aligned (fused_supported admits no other qkv; a violation here is a caller's bug)."""
    if dim % 8 or dim > 8 * _THREADS:
        raise ValueError(f"fused RoPE needs a head width that is a multiple of 8 (at most {8 * _THREADS}), not {dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or not table.is_contiguous() or not _aligned(table, 16) \
                or table.shape[-1] != dim:
            raise ValueError(f"fused RoPE needs the {name} table fp32, contiguous, 16-byte aligned, [seq, {dim}]")


def rope_forward_(qkv5: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k of the packed qkv5 [B, T, 3, heads, D] in place."""
    batch, seq, _, heads, dim = qkv5.shape
    if not qkv5.is_cuda:
        qk = qkv5[:, :, :2]
        qk.copy_(apply_rope(qk.transpose(1, 3), cos, sin).transpose(1, 3))
        return
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    _check_kernel_shapes(dim, cos, sin)
    if not (qkv5.is_contiguous() and _aligned(qkv5, 8)):
        raise ValueError("fused RoPE rotates a contiguous, 8-byte aligned qkv in place")
    rows = batch * seq * 2 * heads
    kernel, _ = load_kernel(KERNEL_SOURCE, "pl_rope_forward", qkv5.device.index)
    launch_raw(kernel, _grid(rows, dim), _THREADS, "pppqiii",
               (qkv5.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, seq, heads, dim), qkv5.device)


def rope_backward_pack(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """d{q,k,v} [B, heads, T, D] -> packed dqkv [B, T, 3, heads, D] with the transposed rotation on dq and dk
    (into `out` where given: the tests poison it)."""
    batch, heads, seq, dim = dq.shape
    if not dq.is_cuda:
        dq, dk = (apply_rope(g, cos, -sin) for g in (dq, dk))  # the transposed rotation: the angle negated
        return torch.stack([dq, dk, dv], dim=1).permute(0, 3, 1, 2, 4).contiguous()
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    _check_kernel_shapes(dim, cos, sin)
    # The kernel reads four elements (8 bytes) at a time: one stride set for the three, the last dimension dense,
    # every stride a multiple of 4 elements and every pointer 8-byte aligned; anything else is copied first.
    if not (dq.stride() == dk.stride() == dv.stride() and dq.stride(-1) == 1
            and all(x % 4 == 0 for x in dq.stride()[:3]) and all(_aligned(g, 8) for g in (dq, dk, dv))):
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    if out is None:
        out = torch.empty(batch, seq, 3, heads, dim, dtype=dq.dtype, device=dq.device)
    if not (out.is_contiguous() and _aligned(out, 8)):
        raise ValueError("fused RoPE writes dqkv into a contiguous, 8-byte aligned tensor")
    rows = batch * seq * 3 * heads
    kernel, _ = load_kernel(KERNEL_SOURCE, "pl_rope_backward_pack", dq.device.index)
    sb, sh, st, _ = dq.stride()
    launch_raw(kernel, _grid(rows, dim), _THREADS, "ppppppqiiiqqq",
               (dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows,
                seq, heads, dim, sb, sh, st), dq.device)
    return out


# ---- flash attention: torch's CUDA op, its CPU op for the contract tests ----

def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False)
        return out, (lse, cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, (lse,)


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    saved: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        lse, cq, ck, mq, mk, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, saved[0], 0.0,
                                                                               True)


# ---- cuDNN attention: torch's CUDA ops; on the CPU the flash stand-ins (the Function's contract tests) ----

def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    if not q.is_cuda:
        return _flash_forward(q, k, v)
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False)
    return out, (lse, cq, ck, mq, mk, seed, offset)


def _cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    saved: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        return _flash_backward(dout, q, k, v, out, saved)
    lse, cq, ck, mq, mk, seed, offset = saved
    # (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
    #  max_q, max_k, dropout_p, is_causal): what torch's own autograd formula passes
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True)


#: the routes that call an attention's aten ops directly: resolve_backend's answer -> (forward, backward)
_DIRECT_ROUTES = {None: (_flash_forward, _flash_backward),
                  SDPBackend.CUDNN_ATTENTION: (_cudnn_forward, _cudnn_backward)}


def runs_direct(backend: str, sdpa: SDPBackend | None) -> bool:
    """Whether the fused path calls the attention's aten ops itself (no kept graph, no nested autograd): flash and
    cudnn-ops always; auto wherever torch's pick has such a route (flash, cuDNN); cudnn and math go through SDPA."""
    return backend in DIRECT_OPS or (backend == "auto" and sdpa in _DIRECT_ROUTES)


def _views(qkv5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, heads, T, D] as strided views of the packed qkv5 [B, T, 3, heads, D] (two view ops: the host
    cost of an eager call is per op)."""
    return qkv5.permute(2, 0, 3, 1, 4).unbind(0)


def _sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend, restrict: bool
                  ) -> tuple[torch.Tensor, tuple]:
    """Causal attention through torch's SDPA on one backend, recorded for autograd on detached leaves: (output,
    (leaves, output with its graph)) for `_sdpa_backward`. `restrict` limits SDPA to `backend`; without it SDPA
    picks for itself, which is `backend` where that came from torch's own pick for these tensors ("auto")."""
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        if restrict:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return out.detach(), (leaves, out)


def _sdpa_backward(dout: torch.Tensor, graph: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaves, out = graph
    return torch.autograd.grad(out, leaves, dout)


class FusedRopeAttention(torch.autograd.Function):
    """qkv [B, T, 3H] -> [B, T, H]. The input's memory is rotated in place (the qkv Linear saves its input, not its
    output, so nothing else reads it) and kept for the backward, which needs the rotated q and k. `backend`: a
    BACKENDS name (auto: torch's own pick for these tensors, by its direct route where it has one; flash, cudnn-ops:
    that attention's ops; cudnn, math: torch's SDPA on that backend)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                backend: str = "auto") -> torch.Tensor:
        batch, seq, three_h = qkv.shape
        qkv5 = qkv.view(batch, seq, 3, heads, three_h // (3 * heads))
        if cos.shape[0] != seq:
            cos, sin = cos[:seq], sin[:seq]
        rope_forward_(qkv5, cos, sin)
        ctx.heads = heads
        views = _views(qkv5)
        sdpa = resolve_backend(backend, *views)
        if sdpa is not None and not runs_direct(backend, sdpa):
            out, ctx.graph = _sdpa_forward(*views, sdpa, restrict=backend != "auto")
            ctx.save_for_backward(cos, sin)
            return out.transpose(1, 2).reshape(batch, seq, three_h // 3)
        ctx.graph = None
        forward, ctx.backward_op = _DIRECT_ROUTES[sdpa]
        out, saved = forward(*views)
        # the ops' extras mix tensors (logsumexp, the RNG state) with ints and None (sequence bounds)
        tensors = [x for x in saved if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(qkv, out, cos, sin, *tensors)
        ctx.extras = [_SAVED if isinstance(x, torch.Tensor) else x for x in saved]
        ctx.heads = heads
        return out.transpose(1, 2).reshape(batch, seq, three_h // 3)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.graph is not None:
            cos, sin = ctx.saved_tensors
            leaves, _ = ctx.graph
            batch, heads, seq, _dim = leaves[0].shape
            dout = dy.reshape(batch, seq, heads, -1).transpose(1, 2)
            dq, dk, dv = _sdpa_backward(dout, ctx.graph)
            ctx.graph = None  # the kept graph's memory goes with this microbatch's backward
            return rope_backward_pack(dq, dk, dv, cos, sin).view(batch, seq, -1), None, None, None, None
        qkv, out, cos, sin, *tensors = ctx.saved_tensors
        given = iter(tensors)
        saved = [next(given) if x is _SAVED else x for x in ctx.extras]
        batch, seq, three_h = qkv.shape
        qkv5 = qkv.view(batch, seq, 3, ctx.heads, three_h // (3 * ctx.heads))
        dout = dy.reshape(batch, seq, ctx.heads, -1).transpose(1, 2)
        dq, dk, dv = ctx.backward_op(dout, *_views(qkv5), out, tuple(saved))
        return rope_backward_pack(dq, dk, dv, cos, sin).view(batch, seq, three_h), None, None, None, None


def fused_supported(qkv: torch.Tensor, heads: int) -> bool:
    """Whether the fused path takes this qkv: CUDA bf16, a head width flash attention accepts (even, a multiple
    of 8, at most 256)."""
    dim = qkv.shape[-1] // (3 * heads)
    return qkv.is_cuda and qkv.dtype == torch.bfloat16 and dim % 8 == 0 and dim <= 256 and qkv.is_contiguous()


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, impl: str = "torch",
                   backend: str | None = None) -> torch.Tensor:
    """Causal self-attention with RoPE of qkv [B, T, 3H] -> [B, T, H]: fused where `impl` is not "torch" and the
    tensor qualifies (fused_supported), the unfused reference otherwise. `backend`: a BACKENDS name, read from
    PEERLINE_ATTENTION when None (a model reads it once, when it is built)."""
    if impl != "torch" and fused_supported(qkv, heads):
        return FusedRopeAttention.apply(qkv, cos, sin, heads, backend or attention_backend())
    return attention_reference(qkv, cos, sin, heads)
