"""Host time per call of one GPT block, forward + backward with bf16 weights: peerline's GPTBlock with
`--kernels auto` and with `--kernels torch`, and the plain torch GPT's TransformerBlock (the gpt suite's anchor),
then peerline auto's forward part by part (norm, qkv, RoPE attention, proj, residual add, fc1 + bias + GELU, fc2).
`--rope-parts` (also run by `--profile`) takes FusedRopeAttention (kernels/rope.py) apart on the qkv the block
produces: each piece of its forward and backward (shape checks, the kernel lookup, the raw stream, the argument
values and the launch, the rotation, the backend pick, the attention ops, the backward pack) and the whole
Function with and without grad, printed as `INFO rope part: <name> <us> us`, with `INFO rope derived:` lines for
what the Function costs beyond the pieces it runs (the autograd machinery and ctx bookkeeping).

The shape is small (the launch-bound GPT's by default), so the device never falls behind and each figure is the
host's cost: where an eager iteration spends its host time when the device waits for it. peerline's calls run
inside `eager_only()`, as the runtime runs an eager iteration.

    PYTHONPATH=$PWD python3 tools/gpu_probes/gpt_block_host_probe.py [--hidden 256 --heads 4 --seq 256 --batch 2]
        [--rope-parts] [--profile]
    (--device cpu runs the same calls on the CPU: a check that the probe runs, not a figure of a GPU; the rope
    parts that exist only on CUDA (kernel lookup, raw stream, launches) are skipped there, on one line)
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from auto_host_probe import per_call_us as host_us  # a sibling script (its folder is on sys.path)

from peerline.bench.suites.plain_gpt import TransformerBlock, precompute_freqs_cis
from peerline.kernels import elementwise, launch, ops, rope
from peerline.kernels.capture_state import eager_only
from peerline.kernels.compile import load_kernel
from peerline.kernels.rope import FusedRopeAttention, rope_attention
from peerline.models.gpt import GPTBlock

log = logging.getLogger("gpt_block_host_probe")


def per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """auto_host_probe's host time per call (median of 5 rounds) after one untimed call, which loads and compiles
    what the call needs."""
    fn()
    return host_us(fn, calls, torch.cuda.synchronize if device.type == "cuda" else lambda: None)


def eager_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """per_call_us of `fn` run inside eager_only(), as the runtime runs an eager iteration's calls."""
    def under_eager() -> object:
        with eager_only():
            return fn()
    return per_call_us(under_eager, calls, device)


def peerline_block(hidden: int, heads: int, impl: str, seq: int, device: torch.device) -> GPTBlock:
    """peerline's block with bf16 parameters and its RoPE tables left fp32, as the runtime casts it (the fused RoPE
    kernel reads fp32 tables)."""
    block = GPTBlock(hidden, heads, impl, max_seq=seq).to(device)
    for p in block.parameters():
        p.data = p.data.to(torch.bfloat16)
    return block


def probe(hidden: int, heads: int, seq: int, batch: int, calls: int, device: torch.device) -> dict[str, float]:
    """Every figure, microseconds per call, by name."""
    dtype = torch.bfloat16
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    got: dict[str, float] = {}
    blocks = {impl: peerline_block(hidden, heads, impl, seq, device) for impl in ("auto", "torch")}
    for impl, block in blocks.items():
        got[f"peerline GPTBlock {impl} fwd+bwd"] = eager_us(lambda block=block: block(x).sum().backward(), calls,
                                                            device)
    plain = TransformerBlock(hidden, heads).to(device, dtype)
    freqs = precompute_freqs_cis(hidden // heads, seq).to(device)
    got["plain TransformerBlock fwd+bwd"] = per_call_us(lambda: plain(x, freqs).sum().backward(), calls, device)

    b = blocks["auto"]
    h = b.norm1(x)
    qkv = b.qkv(h)
    y = rope_attention(qkv, b.rope_cos, b.rope_sin, b.heads, "auto", b.attention_impl)
    parts: dict[str, Callable[[], object]] = {
        "norm": lambda: b.norm1(x),
        "qkv": lambda: b.qkv(h),
        "rope attention": lambda: rope_attention(qkv, b.rope_cos, b.rope_sin, b.heads, "auto", b.attention_impl),
        "proj": lambda: b.proj(y),
        "residual add": lambda: ops.residual_add(x, h, "auto"),
        "fc1 + bias + gelu": lambda: ops.linear_bias_gelu(b.fc1, h, b.fc1_bias, "auto"),
        "fc2": lambda: b.fc2(ops.linear_bias_gelu(b.fc1, h, b.fc1_bias, "auto")),
    }
    for name, fn in parts.items():
        got[f"peerline auto fwd part: {name}"] = eager_us(fn, calls, device)
    return got


def host_profiles(hidden: int, heads: int, seq: int, batch: int, device: torch.device) -> dict[str, str]:
    """torch.profiler's table of host ops by self CPU time, 20 forward + backward calls, per block."""
    dtype = torch.bfloat16
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    block = peerline_block(hidden, heads, "auto", seq, device)
    plain = TransformerBlock(hidden, heads).to(device, dtype)
    freqs = precompute_freqs_cis(hidden // heads, seq).to(device)

    def ours() -> None:
        with eager_only():
            block(x).sum().backward()

    def theirs() -> None:
        plain(x, freqs).sum().backward()

    out = {}
    for name, fn in (("peerline GPTBlock auto", ours), ("plain TransformerBlock", theirs)):
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                fn()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return out


@dataclass
class RopeInputs:
    """What FusedRopeAttention works on inside the block: the qkv Linear's output (detached), the tables cut to the
    sequence as its forward cuts them, and the block's attention backend name."""

    qkv: torch.Tensor  # [B, T, 3H], bf16, contiguous
    cos: torch.Tensor  # [T, D], fp32
    sin: torch.Tensor
    heads: int
    backend: str  # a rope.BACKENDS name (PEERLINE_ATTENTION, read when the block is built)

    @property
    def qkv5(self) -> torch.Tensor:
        batch, seq, three_h = self.qkv.shape
        return self.qkv.view(batch, seq, 3, self.heads, three_h // (3 * self.heads))


def rope_inputs(hidden: int, heads: int, seq: int, batch: int, device: torch.device) -> RopeInputs:
    """peerline auto's block, run up to its qkv Linear on bf16 activations, as in `probe`."""
    block = peerline_block(hidden, heads, "auto", seq, device)
    x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        qkv = block.qkv(block.norm1(x)).contiguous()
    return RopeInputs(qkv, block.rope_cos[:seq], block.rope_sin[:seq], block.heads, block.attention_impl)


def rope_forward_imports() -> None:
    """The imports rope_forward_ and rope_backward_pack run inside the function on every CUDA call (modules
    already loaded: a sys.modules lookup each)."""
    from peerline.kernels.compile import load_kernel  # noqa: F401
    from peerline.kernels.elementwise import launch_raw  # noqa: F401


def rope_args(qkv5: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, ...]:
    """The values rope_forward_ passes pl_rope_forward, built the same way (data_ptr and all)."""
    batch, seq, _, heads, dim = qkv5.shape
    rows = batch * seq * 2 * heads
    return (qkv5.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, seq, heads, dim)


def rope_common_parts(r: RopeInputs) -> dict[str, Callable[[], object]]:
    """The forward's pieces that run on any device. rope_forward_ rotates in place, so it gets a scratch copy (the
    values drift call after call; the host cost does not)."""
    scratch = r.qkv.clone()
    scratch5 = scratch.view(r.qkv5.shape)
    dim = r.qkv5.shape[-1]
    seq = r.qkv.shape[1]
    return {
        "qkv.view to qkv5 + cos/sin[:seq]": lambda: (r.qkv.view(r.qkv5.shape), r.cos[:seq], r.sin[:seq]),
        "_views(qkv5)": lambda: rope._views(r.qkv5),
        "in-function imports (load_kernel, launch_raw)": rope_forward_imports,
        "_check_kernel_shapes(dim, cos, sin)": lambda: rope._check_kernel_shapes(dim, r.cos, r.sin),
        "argument values (data_ptr x3, rows, seq, heads, dim)": lambda: rope_args(scratch5, r.cos, r.sin),
        "rope_forward_(qkv5, cos, sin) whole": lambda: rope.rope_forward_(scratch5, r.cos, r.sin),
    }


def rope_cuda_parts(r: RopeInputs) -> dict[str, Callable[[], object]]:
    """The forward's pieces that exist only on CUDA: the kernel lookup, the stream handle and the launch, each with
    the arguments rope_forward_ gives it (the launches rotate a scratch copy)."""
    scratch5 = r.qkv.clone().view(r.qkv5.shape)
    device = scratch5.device
    batch, seq, _, heads, dim = scratch5.shape
    grid = rope._grid(batch * seq * 2 * heads, dim)
    kernel, _ = load_kernel(rope.KERNEL_SOURCE, "pl_rope_forward", device.index)
    args = rope_args(scratch5, r.cos, r.sin)
    stream = launch.raw_stream(device.index)
    pack = launch.ArgPack("pppqiii", args)
    packed = launch.Kernel(kernel)
    return {
        "qkv5.device.index": lambda: scratch5.device.index,
        "load_kernel(KERNEL_SOURCE, 'pl_rope_forward', index)": lambda: load_kernel(rope.KERNEL_SOURCE,
                                                                                   "pl_rope_forward", device.index),
        "launch.raw_stream(index)": lambda: launch.raw_stream(device.index),
        "launch.launch, a fixed pack (the driver call alone)": lambda: launch.launch(packed, grid, (rope._THREADS, 1),
                                                                                    0, stream, pack),
        "launch.launch_values (stream given)": lambda: launch.launch_values(kernel, "pppqiii", grid, rope._THREADS,
                                                                            args, 0, stream),
        "elementwise.launch_raw (its raw_stream included)": lambda: elementwise.launch_raw(
            kernel, grid, rope._THREADS, "pppqiii", args, device),
    }


AttentionParts = tuple[dict[str, Callable[[], object]], torch.Tensor, tuple[torch.Tensor, ...]]


def direct_attention_parts(views: tuple[torch.Tensor, ...], dout: torch.Tensor, sdpa: object) -> AttentionParts:
    """(the direct route's forward and backward aten calls as the Function makes them, the forward's output, the
    backward's dq, dk, dv)."""
    forward, backward = rope._DIRECT_ROUTES[sdpa]
    out, saved = forward(*views)
    parts = {"attention forward (direct route's aten op)": lambda: forward(*views),
             "attention backward (direct route's aten op)": lambda: backward(dout, *views, out, saved)}
    return parts, out, backward(dout, *views, out, saved)


def sdpa_attention_parts(views: tuple[torch.Tensor, ...], dout: torch.Tensor, sdpa: object, restrict: bool
                         ) -> AttentionParts:
    """The same for the SDPA route: its backward frees the graph the forward kept, so the backward is timed with a
    fresh forward each call (forward + backward)."""
    def step() -> tuple[torch.Tensor, ...]:
        _, graph = rope._sdpa_forward(*views, sdpa, restrict=restrict)
        return rope._sdpa_backward(dout, graph)

    parts = {"attention forward (SDPA route)": lambda: rope._sdpa_forward(*views, sdpa, restrict=restrict),
             "attention forward + backward (SDPA route)": step}
    return parts, rope._sdpa_forward(*views, sdpa, restrict=restrict)[0], step()


def attention_parts(r: RopeInputs) -> dict[str, Callable[[], object]]:
    """The backend pick, the attention between the rotations by the route the Function takes for this backend
    (direct aten ops, or SDPA with a kept graph), the reshape of the output the Function returns, and
    rope_backward_pack on the attention backward's dq, dk, dv."""
    views = rope._views(r.qkv5)
    sdpa = rope.resolve_backend(r.backend, *views)
    direct = rope.runs_direct(r.backend, sdpa)
    log.info("rope attention route: %s -> %s, %s", r.backend, sdpa, "direct aten ops" if direct else
             "SDPA with a kept graph")
    batch, seq, three_h = r.qkv.shape
    dy = torch.randn(batch, seq, three_h // 3, device=r.qkv.device, dtype=r.qkv.dtype)
    dout = dy.reshape(batch, seq, r.heads, -1).transpose(1, 2)  # the layout the Function's backward passes
    parts: dict[str, Callable[[], object]] = {
        f"resolve_backend({r.backend!r}, *views)": lambda: rope.resolve_backend(r.backend, *views),
        f"runs_direct({r.backend!r}, sdpa)": lambda: rope.runs_direct(r.backend, sdpa),
    }
    route, out, (dq, dk, dv) = direct_attention_parts(views, dout, sdpa) if direct else \
        sdpa_attention_parts(views, dout, sdpa, restrict=r.backend != "auto")
    parts.update(route)
    log.info("attention backward's dq, dk, dv strides: %s, %s, %s (rope_backward_pack copies them first unless the "
             "three match, the last is 1 and the rest are multiples of 4)", dq.stride(), dk.stride(), dv.stride())
    # the Function's return: [B, heads, T, D] -> [B, T, H] (a copy where the op's output is heads-major in memory)
    parts["output out.transpose(1, 2).reshape"] = lambda: out.transpose(1, 2).reshape(batch, seq, three_h // 3)
    parts["rope_backward_pack(dq, dk, dv, cos, sin)"] = lambda: rope.rope_backward_pack(dq, dk, dv, r.cos, r.sin)
    return parts


class _EmptyFunction(torch.autograd.Function):
    """An autograd.Function with FusedRopeAttention's signature that saves three tensors and returns a view: the
    cost of the Function machinery itself on this host, as a reference."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                backend: str) -> torch.Tensor:
        ctx.save_for_backward(qkv, cos, sin)
        ctx.heads = heads
        return qkv.view_as(qkv)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, None, None, None, None


def apply_parts(r: RopeInputs) -> dict[str, Callable[[], object]]:
    """The whole Function as the block calls it (on a leaf scratch copy that requires grad, as the qkv Linear's
    output does; it is rotated in place call after call), without grad, with grad, and forward + backward."""
    leaf = r.qkv.clone().requires_grad_(True)
    batch, seq, three_h = r.qkv.shape
    dy = torch.randn(batch, seq, three_h // 3, device=r.qkv.device, dtype=r.qkv.dtype)

    def no_grad() -> torch.Tensor:
        with torch.no_grad():
            return FusedRopeAttention.apply(leaf, r.cos, r.sin, r.heads, r.backend)

    def fwd_bwd() -> None:
        leaf.grad = None  # each backward stores its gradient afresh, as the block's qkv passes it on
        FusedRopeAttention.apply(leaf, r.cos, r.sin, r.heads, r.backend).backward(dy)

    return {
        "empty Function.apply, with grad (reference)": lambda: _EmptyFunction.apply(leaf, r.cos, r.sin, r.heads,
                                                                                     r.backend),
        "FusedRopeAttention.apply forward, no_grad": no_grad,
        "FusedRopeAttention.apply forward, with grad": lambda: FusedRopeAttention.apply(leaf, r.cos, r.sin, r.heads,
                                                                                        r.backend),
        "FusedRopeAttention.apply forward + backward": fwd_bwd,
    }


def rope_parts(hidden: int, heads: int, seq: int, batch: int, calls: int, device: torch.device
               ) -> tuple[dict[str, float], list[str]]:
    """(microseconds per call by piece, the CUDA-only pieces skipped on this device). Each piece runs under
    eager_only(), as the block's forward does in `probe`."""
    r = rope_inputs(hidden, heads, seq, batch, device)
    pieces = rope_common_parts(r)
    cuda_only = [] if device.type == "cuda" else ["qkv5.device.index", "load_kernel", "launch.raw_stream",
                                                   "launch.launch", "launch.launch_values",
                                                   "elementwise.launch_raw"]
    if device.type == "cuda":
        pieces.update(rope_cuda_parts(r))
    pieces.update(attention_parts(r))
    pieces.update(apply_parts(r))
    got = {name: eager_us(fn, calls, device) for name, fn in pieces.items()}
    got.update(backward_inside_us(r, calls, device))
    return got, cuda_only


def backward_inside_us(r: RopeInputs, calls: int, device: torch.device) -> dict[str, float]:
    """Host time spent inside FusedRopeAttention.backward and inside its rope_backward_pack call, measured on the
    thread that runs them (autograd's worker on CUDA) over `calls` forward + backward calls: what the backward's
    own code costs, apart from the autograd engine around it."""
    spent = {"backward body": 0.0, "rope_backward_pack": 0.0}
    original_backward, original_pack = FusedRopeAttention.backward, rope.rope_backward_pack

    def timed(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    leaf = r.qkv.clone().requires_grad_(True)
    dy = torch.randn(*r.qkv.shape[:2], r.qkv.shape[2] // 3, device=r.qkv.device, dtype=r.qkv.dtype)
    FusedRopeAttention.backward = staticmethod(timed("backward body", original_backward))
    rope.rope_backward_pack = timed("rope_backward_pack", original_pack)
    try:
        with eager_only():
            FusedRopeAttention.apply(leaf, r.cos, r.sin, r.heads, r.backend).backward(dy)  # untimed: loads
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            spent.update(dict.fromkeys(spent, 0.0))
            for _ in range(calls):
                leaf.grad = None
                FusedRopeAttention.apply(leaf, r.cos, r.sin, r.heads, r.backend).backward(dy)
    finally:
        FusedRopeAttention.backward, rope.rope_backward_pack = original_backward, original_pack
    return {"FusedRopeAttention.backward body, timed inside": spent["backward body"] / calls * 1e6,
            "rope_backward_pack, timed inside the backward": spent["rope_backward_pack"] / calls * 1e6}


def rope_derived(got: dict[str, float]) -> dict[str, float]:
    """Differences of the pieces: the backward alone, what grad mode adds, and what the Function's forward and
    backward cost beyond the pieces they run (the autograd machinery, ctx bookkeeping, the saved tensors, the
    backward's thread); any can come out negative within the noise."""
    fwd = got["FusedRopeAttention.apply forward, with grad"]
    inside = got["qkv.view to qkv5 + cos/sin[:seq]"] + got["rope_forward_(qkv5, cos, sin) whole"] \
        + got["_views(qkv5)"] + sum(us for name, us in got.items() if name.startswith(("resolve_backend(",
                                                                                       "runs_direct(")))
    inside += got["output out.transpose(1, 2).reshape"]
    inside += got.get("attention forward (direct route's aten op)", got.get("attention forward (SDPA route)", 0.0))
    bwd = got["FusedRopeAttention.apply forward + backward"] - fwd
    derived = {
        "backward (forward + backward minus forward with grad)": bwd,
        "grad mode (forward with grad minus no_grad)": fwd - got["FusedRopeAttention.apply forward, no_grad"],
        "forward beyond its pieces (with grad minus views, rope_forward_, backend pick, attention, reshape)":
            fwd - inside,
    }
    if "attention backward (direct route's aten op)" in got:
        derived["backward beyond its pieces (backward minus attention backward, rope_backward_pack)"] = bwd - got[
            "attention backward (direct route's aten op)"] - got["rope_backward_pack(dq, dk, dv, cos, sin)"]
    derived["autograd around the backward (backward minus its body timed inside)"] = bwd - got[
        "FusedRopeAttention.backward body, timed inside"]
    return derived


def log_rope_parts(hidden: int, heads: int, seq: int, batch: int, calls: int, device: torch.device) -> None:
    """Print every rope piece as `rope part: <name> <us> us`, the skipped CUDA-only pieces on one line, and the
    derived differences as `rope derived: <name> <us> us`."""
    got, skipped = rope_parts(hidden, heads, seq, batch, calls, device)
    if skipped:
        log.info("rope parts skipped on %s (CUDA only): %s", device.type, ", ".join(skipped))
    for name, us in got.items():
        log.info("rope part: %s %.1f us", name, us)
    for name, us in rope_derived(got).items():
        log.info("rope derived: %s %.1f us", name, us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's host ops by self CPU "
                        "time for peerline's block (auto) and the plain block, forward + backward; runs "
                        "--rope-parts too")
    parser.add_argument("--rope-parts", action="store_true", help="time each piece of FusedRopeAttention's "
                        "forward and backward (kernels/rope.py) on the block's qkv, host time per call")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="INFO %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU"
    log.info("%s, torch %s: GPT block hidden %d, %d heads, %d x %d tokens, bf16 weights, %d calls per round", name,
             torch.__version__, args.hidden, args.heads, args.batch, args.seq, args.calls)
    for what, us in probe(args.hidden, args.heads, args.seq, args.batch, args.calls, device).items():
        log.info("%-45s %9.1f us", what, us)
    if args.rope_parts or args.profile:
        log_rope_parts(args.hidden, args.heads, args.seq, args.batch, args.calls, device)
    if args.profile:
        for what, table in host_profiles(args.hidden, args.heads, args.seq, args.batch, device).items():
            log.info("%s: host ops by self CPU time over 20 calls\n%s", what, table)


if __name__ == "__main__":
    main()
