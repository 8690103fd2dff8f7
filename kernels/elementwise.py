"""torch autograd Functions over the warp-specialized kernels of elementwise.cu.

    bias_gelu(x, bias)    gelu(x + bias), exact erf GELU, bias [H] broadcast over x's last dimension (size H)
    residual_add(x, y)    x + y, same shapes, result dtype torch.result_type(x, y)

Launch path: kernels are launched on torch's current stream (so they follow the engine's compute stream and can
be captured into CUDA graphs), with raw pointers of the torch tensors (zero copy). No host synchronization and
no cudaMalloc: outputs and the bias-gradient workspace come from torch's caching allocator on the current stream.
The first call per (device, op, dtypes) compiles with NVRTC: do it before capturing (warm-up).

Dtypes: x, y, bias in {float32, bfloat16}, mixed as bf16 autocast produces them, without cast kernels:
bias_gelu(x bf16, bias fp32) -> bf16 out, bias grad accumulated in fp32 and returned in bias's dtype;
residual_add(x fp32, y bf16) -> fp32. What is cast (documented, cheap and rare): in the backward, a grad whose
dtype differs from x's is cast to x's dtype. Anything else (fp16, fp64, broadcasting residual shapes) falls back
to the torch reference, with one log line per case.

Non-contiguous inputs are made contiguous (a copy). Contiguous views at any offset (even misaligned by one
element) stay on the vector path: outputs are allocated with the same misalignment, and the kernel runs a
scalar head and tail around the 16-byte-aligned body. Operands that cannot share one alignment (e.g. a caller's
misaligned `out`) run the scalar kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from peerline import overrides
from peerline.kernels import compile as kc
from peerline.kernels import launch, plan
from peerline.kernels.capture_state import capturing
from peerline.kernels.card_table import PEERLINE, CardTable, table_for
from peerline.kernels.reference import bias_gelu_reference, residual_add_reference

log = logging.getLogger(__name__)

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SCALAR_THREADS = 256
T = TypeVar("T")
# The residual add's vector path is pl_flat (elementwise.cu: one chunk per thread, PL_FLAT_THREADS per block); the
# warp-specialized engine runs it only when an experiment asks for it (TUNING {"engine": 1, ...}: the variants).
FLAT_THREADS = 256
# Test hook: fill every output and workspace with NaN before the launch, so an element the kernel never writes
# fails the comparison (torch.empty may hand back memory that already holds the right answer).
POISON_OUTPUTS = False
# Experiment hook (benchmarks, the sweep): KernelSpec overrides such as {"warps": 8, "stages": 3} plus the grid
# keys "blocks_per_sm" (grid cap per SM) and "rounds" (at most r tiles per block: a grid beyond the resident
# blocks), as plan.LaunchPlan.tuning() makes them, and "grid_cap" (absolute cap on the resident grid: the
# sanitizer run makes 2 blocks wrap their pipeline stages; with rounds the grid still grows to ntiles / r);
# empty = the design.
TUNING: dict[str, int] = {}
_warned: set[str] = set()
# Per-op launch plans, as the sweep (peerline.bench.kernel_tools.sweep) chose them on H100/H200 (tables in
# docs/benchmarks/kernels-history.md). Residual add has two size classes: a ":l2" plan where the bytes moved fit in
# 1.5 x L2 (plan.in_l2: evict-first bulk loads leave the results in L2), streaming stores with one tile per block
# beyond it. PEERLINE_KERNEL_PLANS="OP[:DTYPE][:l2]=PLAN,..." (plan.parse_op_plans) goes on top, e.g.
# "residual_add=w8.s4.d1"; PEERLINE_KERNEL_PLANS=default drops the tuned plans. Used when TUNING is empty.
TUNED_PLANS = ("bias_gelu_fwd:bf16=w16.s3.t1024.d1.l1.p1,bias_gelu_fwd:fp32=w12.s4.d1.l1.r8,bias_gelu_bwd:bf16=w8.s4,"
               "bias_gelu_bwd:fp32=w12.s2.d1,residual_add:bf16=w4.s4.t128.d1.l1.h1.r1,"
               "residual_add:fp32=w4.s4.t128.d1.l1.h1.r1,residual_add:bf16:l2=w4.s2.t256.d1.l1.h2.r1,"
               "residual_add:fp32:l2=w4.s2.t256.d1.l1.h2.r1")
_USER_PLANS = overrides.get_str("PEERLINE_KERNEL_PLANS", "")
OP_PLANS = ({} if _USER_PLANS.strip() == "default" else
            {**plan.parse_op_plans(TUNED_PLANS), **plan.parse_op_plans(_USER_PLANS)})
_OP_NAME = {kc.OP_BIAS_GELU_FWD: "bias_gelu_fwd", kc.OP_BIAS_GELU_BWD: "bias_gelu_bwd",
            kc.OP_RESIDUAL_ADD: "residual_add"}
_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("peerline kernels: falling back to torch: %s", reason)


def _supported(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.dtype in _DTYPES for t in tensors)


def _new(shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device, head: int | None) -> torch.Tensor:
    """A contiguous output of `shape` whose flat element `head` is 16-byte aligned (any alignment if head is None).

    Never a view (its ._base is None): an autograd Function that returns a view of a tensor it created makes
    autograd forbid later in-place writes to the result ("Output 0 of ResidualAddBackward is a view ... modified
    inplace"). The misaligned case therefore points a fresh tensor at the padded buffer's storage with `set_`
    instead of slicing it. Head 0 (aligned inputs) takes a plain allocation: the caching allocator's blocks are
    512-byte aligned, checked once per call."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if head is not None and (head or t.data_ptr() & 15):
        shape = tuple(t.shape)
        n = t.numel()
        per = plan.VECTOR_BYTES // dtype.itemsize
        buf = torch.empty(n + per, dtype=dtype, device=device)
        off = plan.output_offset(buf.data_ptr(), buf.element_size(), head)
        t = torch.empty(0, dtype=dtype, device=device)
        t.set_(buf.untyped_storage(), off, shape, torch.empty(shape, device="meta").stride())
    if POISON_OUTPUTS:
        t.fill_(float("nan"))
    return t


def _check_out(out: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not out.is_contiguous() or out.numel() != n or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be a contiguous {dtype} tensor of {n} elements on {device}")
    return out


def launch_raw(fn: Any, grid: int, block: int, kinds: str, values: Sequence[int | float], device: torch.device,
               smem: int = 0) -> None:
    """Launch a CuPy kernel (1-D grid and block; `values` plain ints and floats, typed by `kinds` as launch.ArgPack
    reads them) on torch's current stream of `device`, so it follows the engine's streams and can be captured into
    a CUDA graph, through launch.py's pre-packed launcher (a few microseconds of host time, where CuPy's own call
    packs numpy scalars and wraps a stream per launch). The runtime's small kernels (RoPE, LayerNorm, compact
    AdamW, distributed/data/counter.py) launch this way."""
    launch.launch_values(fn, kinds, grid, block, values, smem, launch.raw_stream(device.index))


# Tuning keys that are not KernelSpec fields: the grid's, and "engine" (the residual add through pl_main)
_GRID_KEYS = (*plan.GRID_KEYS, "grid_cap", "engine")
_BUILTIN_OP_PLANS = OP_PLANS  # a replaced OP_PLANS (tests, experiments) is used as it is, without a card's plans


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


@functools.cache
def card_name(device_index: int) -> str:
    """The device's name ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), the key of kernels/card_plans.json; "" without
    CUDA."""
    return torch.cuda.get_device_name(device_index) if torch.cuda.is_available() else ""


@functools.cache
def card_table(device_index: int) -> CardTable:
    """The card's tuned entry (card_table.table_for), read once per device."""
    return table_for(card_name(device_index))


_merged: dict[int, dict[str, plan.LaunchPlan]] = {}


def op_plans(device_index: int | None = None) -> dict[str, plan.LaunchPlan]:
    """The launch plans of a device: TUNED_PLANS, then its card's tuned plans, then PEERLINE_KERNEL_PLANS on top
    (PEERLINE_KERNEL_PLANS=default: none). Without a device, or with OP_PLANS replaced, OP_PLANS itself."""
    if device_index is None or OP_PLANS is not _BUILTIN_OP_PLANS or not OP_PLANS:
        return OP_PLANS
    merged = _merged.get(device_index)
    if merged is None:
        card = card_table(device_index).plans
        merged = {**plan.parse_op_plans(TUNED_PLANS), **plan.parse_op_plans(card), **plan.parse_op_plans(_USER_PLANS)}
        _merged[device_index] = merged
    return merged


def _in_l2(bytes_moved: int, device: torch.device) -> bool:
    """Whether a launch moving `bytes_moved` bytes fits this device's L2 (plan.in_l2: the ":l2" plans apply)."""
    return plan.in_l2(bytes_moved, _l2_bytes(device.index))


def _tuning(op: int, x: str, l2: bool = False, device_index: int | None = None) -> dict[str, int]:
    """TUNING if set (experiments), else the op's plan from op_plans(device_index) (tuned, the card's, then
    PEERLINE_KERNEL_PLANS; `l2`: the launch's bytes fit in L2, so an OP[:DTYPE]:l2 plan comes first), else {} (the
    default plan)."""
    if TUNING:
        return TUNING
    plans = op_plans(device_index)
    p = plan.op_plan(plans, _OP_NAME[op], _SHORT[x], l2) if plans else None
    return p.tuning() if p is not None else {}


def _spec(op: int, x: str, *, l2: bool = False, device_index: int | None = None, **types: str) -> kc.KernelSpec:
    """The KernelSpec of one op with its launch-shape overrides (the grid keys blocks_per_sm, rounds and grid_cap
    are not spec fields)."""
    shape = {k: v for k, v in _tuning(op, x, l2, device_index).items() if k not in _GRID_KEYS}
    return kc.KernelSpec(op, x, **types, **shape)


def _max_grid(op: kc.CompiledOp, l2: bool = False) -> int:
    """The persistent (resident) grid of this op's launches: blocks_per_sm and grid_cap applied."""
    tuning = _tuning(op.spec.op, op.spec.x, l2, op.device_index)
    grid = op.grid_cap(tuning.get("blocks_per_sm", 0))
    cap = tuning.get("grid_cap", 0)
    return min(grid, cap) if cap > 0 else grid


def _rounds(op: kc.CompiledOp, l2: bool = False) -> int:
    """The plan's rounds (plan.vector_grid): 0 = the persistent grid."""
    return _tuning(op.spec.op, op.spec.x, l2, op.device_index).get("rounds", 0)


def _scalar_grid(n: int, op: kc.CompiledOp) -> int:
    return max(1, min(-(-n // SCALAR_THREADS), op.sms * 8))


# ---- prepared launches: everything but the pointers, decided once per (op, dtypes, size, alignment, device) ----


class Launch:
    """One kernel launch with its grid, block, dynamic shared memory and pre-packed arguments (pointers written
    per call)."""

    __slots__ = ("kernel", "grid", "block", "smem", "pack")

    def __init__(self, raw: Any, grid: int, block: tuple[int, int], smem: int, kinds: str, values: tuple) -> None:
        self.kernel = launch.Kernel(raw)
        self.grid, self.block, self.smem = grid, block, smem
        self.pack = launch.ArgPack(kinds, values)

    def fire(self, stream: int) -> None:
        launch_kernel(self, stream)


class Prepared:
    """A cached launch decision: the output's dtype and alignment head, the kernel launch(es), the workspace."""

    __slots__ = ("out_dtype", "out_head", "main", "reduce", "part_elems")

    def __init__(self, out_dtype: torch.dtype, out_head: int | None, main: Launch | None,
                 reduce: Launch | None = None, part_elems: int = 0) -> None:
        self.out_dtype, self.out_head, self.main, self.reduce, self.part_elems = (out_dtype, out_head, main, reduce,
                                                                                   part_elems)


def launch_kernel(item: Launch, stream: int) -> None:
    """Launch one prepared kernel on a raw stream (the tests spy on this function)."""
    launch.launch(item.kernel, item.grid, item.block, item.smem, stream, item.pack)


# (op, dtypes, elements, hidden, 16-byte alignment class of each pointer (-1: an output allocated here), device)
# -> Prepared. Bounded: a run's launches have a handful of shapes; experiments (TUNING set) bypass it.
_CACHE: dict[tuple, Prepared] = {}
MAX_CACHED = 4096


def _cacheable() -> bool:
    global _cache_plans
    if TUNING:
        return False
    if _cache_plans is not OP_PLANS:  # plans replaced (tests, experiments): forget launches decided on the old ones
        _CACHE.clear()
        _cache_plans = OP_PLANS
    return True


_cache_plans = OP_PLANS


def _remember(cache: dict[tuple, T], key: tuple, value: T) -> T:
    """cache[key] = value, the cache emptied first once it holds MAX_CACHED entries (launches and auto's choices)."""
    if len(cache) >= MAX_CACHED:
        cache.clear()
    cache[key] = value
    return value


def prepare_bias_gelu_forward(xt: torch.dtype, bt: torch.dtype, n: int, hidden: int, xa: int, ba: int, ya: int,
                              dev: int) -> Prepared:
    """The forward's launch: xa, ba, ya the 16-byte alignment classes (address % 16) of x, bias and a caller's
    output (-1: allocated here with the inputs' head)."""
    xs = xt.itemsize
    l2 = plan.in_l2(2 * n * xs, _l2_bytes(dev))  # x read, y written
    spec = _spec(kc.OP_BIAS_GELU_FWD, _DTYPES[xt], l2=l2, device_index=dev, bias=_DTYPES[bt])
    addrs = [(xa, xs)] if ya < 0 else [(xa, xs), (ya, xs)]
    head = plan.common_head(addrs, spec.e)
    op = kc.get_op(spec, dev)
    vp = plan.plan_vector(n, head, spec.e, spec.tile_chunks, _max_grid(op, l2), _rounds(op, l2))
    if vp is not None:
        bias_vec = plan.bias_vector_ok(hidden, vp.head, spec.e, ba, bt.itemsize)
        main = Launch(op.main, vp.grid, (spec.threads, 1), spec.smem_bytes, "pppqqqii",
                      (0, 0, 0, n, vp.head, vp.nchunks, hidden, int(bias_vec)))
    else:
        main = Launch(op.scalar, _scalar_grid(n, op), (SCALAR_THREADS, 1), 0, "pppqi", (0, 0, 0, n, hidden))
    return Prepared(xt, head, main)


def prepare_bias_gelu_backward(xt: torch.dtype, bt: torch.dtype, n: int, hidden: int, ga: int, xa: int, ba: int,
                               oa: int, dev: int) -> Prepared:
    """The backward's two launches (grad_x with bias partials, then the column reduction) and the partials'
    size; ga, xa, ba, oa the alignment classes of grad, x, bias and a caller's grad_x (-1: allocated here)."""
    xs = xt.itemsize
    l2 = plan.in_l2(3 * n * xs, _l2_bytes(dev))  # grad and x read, grad_x written
    spec = _spec(kc.OP_BIAS_GELU_BWD, _DTYPES[xt], l2=l2, device_index=dev, bias=_DTYPES[bt])
    head = plan.common_head([(ga, xs), (xa, xs)], spec.e)
    out_head = head
    if oa >= 0 and head is not None:
        head = plan.common_head([(ga, xs), (xa, xs), (oa, xs)], spec.e)
    op = kc.get_op(spec, dev)
    tile_elems = spec.tile_chunks * spec.e
    max_grid = _max_grid(op, l2)  # the persistent grid: a plan's rounds do not apply (partials grow with the grid)
    vp = plan.plan_vector(n, head, spec.e, spec.tile_chunks, max_grid)
    grid = plan.backward_grid(vp.ntiles, hidden, tile_elems, max_grid) if vp is not None else None
    if vp is not None and grid is not None:
        bias_vec = plan.bias_vector_ok(hidden, vp.head, spec.e, ba, bt.itemsize)
        main = Launch(op.main, grid, (spec.threads, 1), spec.smem_bytes, "pppppqqii",
                      (0, 0, 0, 0, 0, vp.head, vp.nchunks, hidden, int(bias_vec)))
        part, rows, shift, rhead, tail = grid * tile_elems, grid * tile_elems // hidden, vp.head, vp.head, vp.tail_start
    else:
        threads = plan.scalar_backward_threads(n, hidden, op.sms * 2048)
        main = Launch(op.scalar, -(-threads // SCALAR_THREADS), (SCALAR_THREADS, 1), 0, "pppppqiq",
                      (0, 0, 0, 0, 0, n, hidden, threads))
        part, rows, shift, rhead, tail = threads, threads // hidden, 0, 0, n
    reduce = Launch(op.reduce, -(-hidden // 32), (32, 32), 0, "pqiqppppqqqp",
                    (0, rows, hidden, shift, 0, 0, 0, 0, n, rhead, tail, 0))
    return Prepared(xt, out_head, main, reduce, part)


def prepare_residual_add(xt: torch.dtype, yt: torch.dtype, n: int, xa: int, ya: int, oa: int, dev: int) -> Prepared:
    """x + y's launch; xa, ya, oa the alignment classes of x, y and a caller's output (-1: allocated here)."""
    rt = torch.promote_types(xt, yt)
    xs, ys, rs = xt.itemsize, yt.itemsize, rt.itemsize
    l2 = plan.in_l2(n * (xs + ys + rs), _l2_bytes(dev))  # x and y read, the sum written
    spec = _spec(kc.OP_RESIDUAL_ADD, _DTYPES[xt], l2=l2, device_index=dev, y=_DTYPES[yt], out=_DTYPES[rt])
    head = plan.common_head([(xa, xs), (ya, ys)], spec.e)
    out_head = head
    if oa >= 0 and head is not None:
        head = plan.common_head([(xa, xs), (ya, ys), (oa, rs)], spec.e)
    op = kc.get_op(spec, dev)
    vp = plan.plan_vector(n, head, spec.e, spec.tile_chunks, _max_grid(op, l2), _rounds(op, l2))
    if vp is not None and op.flat is not None and not TUNING.get("engine"):
        grid = -(-vp.nchunks // FLAT_THREADS)
        main = Launch(op.flat, grid, (FLAT_THREADS, 1), 0, "pppqqq", (0, 0, 0, n, vp.head, vp.nchunks))
    elif vp is not None:
        main = Launch(op.main, vp.grid, (spec.threads, 1), spec.smem_bytes, "pppqqq", (0, 0, 0, n, vp.head, vp.nchunks))
    else:
        main = Launch(op.scalar, _scalar_grid(n, op), (SCALAR_THREADS, 1), 0, "pppq", (0, 0, 0, n))
    return Prepared(rt, out_head, main)


def _align(t: torch.Tensor | None) -> int:
    return -1 if t is None else t.data_ptr() & 15


# ---- raw launches (also used by the tests and the benchmark, with `out=` to poison or reuse outputs) ----


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = gelu(x + bias) in x's dtype and shape."""
    x, bias = x.contiguous(), bias.contiguous()
    n, hidden, dev = x.numel(), x.shape[-1], x.get_device()
    if n == 0:
        return _new(x.shape, x.dtype, x.device, None) if out is None else out.view(x.shape)
    key = (1, x.dtype, bias.dtype, n, hidden, x.data_ptr() & 15, bias.data_ptr() & 15, _align(out), dev)
    p = _CACHE.get(key) if _cacheable() else None
    if p is None:
        p = prepare_bias_gelu_forward(x.dtype, bias.dtype, n, hidden, *key[5:])
        if not TUNING:
            _remember(_CACHE, key, p)
    y = (_new(x.shape, x.dtype, x.device, p.out_head) if out is None
         else _check_out(out, n, x.dtype, x.device).view(x.shape))
    v = p.main.pack.values
    v[0].value, v[1].value, v[2].value = x.data_ptr(), y.data_ptr(), bias.data_ptr()
    launch_kernel(p.main, launch.raw_stream(dev))
    return y


def bias_gelu_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_bias): grad * gelu'(x + bias) in x's dtype, and its sum over all rows, accumulated in fp32,
    in bias's dtype. Deterministic (no atomics)."""
    if grad.dtype != x.dtype:
        grad = grad.to(x.dtype)  # documented cast: autograd hands back y's (= x's) dtype in practice
    grad, x, bias = grad.contiguous(), x.contiguous(), bias.contiguous()
    n, hidden, dev = x.numel(), x.shape[-1], x.get_device()
    if n == 0:
        gx = _new(x.shape, x.dtype, x.device, None) if out is None else out.view(x.shape)
        return gx, torch.zeros(hidden, dtype=bias.dtype, device=x.device)
    key = (2, x.dtype, bias.dtype, n, hidden, grad.data_ptr() & 15, x.data_ptr() & 15, bias.data_ptr() & 15,
           _align(out), dev)
    p = _CACHE.get(key) if _cacheable() else None
    if p is None:
        p = prepare_bias_gelu_backward(x.dtype, bias.dtype, n, hidden, *key[5:])
        if not TUNING:
            _remember(_CACHE, key, p)
    gx = (_new(x.shape, x.dtype, x.device, p.out_head) if out is None
          else _check_out(out, n, x.dtype, x.device).view(x.shape))
    gb = _new(hidden, bias.dtype, x.device, None)
    part = _new(p.part_elems, torch.float32, x.device, None)
    pg, px, pgx, pb, pp = grad.data_ptr(), x.data_ptr(), gx.data_ptr(), bias.data_ptr(), part.data_ptr()
    v = p.main.pack.values
    v[0].value, v[1].value, v[2].value, v[3].value, v[4].value = pg, px, pgx, pb, pp
    r = p.reduce.pack.values
    r[0].value, r[4].value, r[5].value, r[6].value, r[7].value, r[11].value = pp, pg, px, pgx, pb, gb.data_ptr()
    stream = launch.raw_stream(dev)
    launch_kernel(p.main, stream)
    launch_kernel(p.reduce, stream)
    return gx, gb


def residual_add_forward(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x + y (same shapes) in torch.result_type(x, y)."""
    x, y = x.contiguous(), y.contiguous()
    n, dev = x.numel(), x.get_device()
    if n == 0:
        rt = torch.result_type(x, y)
        return _new(x.shape, rt, x.device, None) if out is None else out.view(x.shape)
    key = (3, x.dtype, y.dtype, n, x.data_ptr() & 15, y.data_ptr() & 15, _align(out), dev)
    p = _CACHE.get(key) if _cacheable() else None
    if p is None:
        p = prepare_residual_add(x.dtype, y.dtype, n, *key[4:])
        if not TUNING:
            _remember(_CACHE, key, p)
    o = (_new(x.shape, p.out_dtype, x.device, p.out_head) if out is None
         else _check_out(out, n, p.out_dtype, x.device).view(x.shape))
    v = p.main.pack.values
    v[0].value, v[1].value, v[2].value = x.data_ptr(), y.data_ptr(), o.data_ptr()
    launch_kernel(p.main, launch.raw_stream(dev))
    return o


# ---- autograd ----


class BiasGelu(torch.autograd.Function):
    """gelu(x + bias) with the fused forward and the fused backward (grad_x and the bias gradient in one pass)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        return bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, bias = ctx.saved_tensors
        gx, gb = bias_gelu_backward(grad, x, bias)
        return (gx if ctx.needs_input_grad[0] else None), (gb if ctx.needs_input_grad[1] else None)


class ResidualAdd(torch.autograd.Function):
    """x + y; the backward hands the incoming gradient to both inputs in their own dtypes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.dtypes = (x.dtype, y.dtype)
        return residual_add_forward(x, y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dx, dy = ctx.dtypes
        gx = grad.to(dx) if ctx.needs_input_grad[0] else None
        gy = grad.to(dy) if ctx.needs_input_grad[1] else None
        return gx, gy


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias) through the peerline kernels (torch reference for unsupported dtypes)."""
    if bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: bias must be 1-D with x.shape[-1] = {x.shape[-1] if x.dim() else '?'} "
                         f"elements, got bias shape {tuple(bias.shape)}")
    if not _supported(x, bias) or x.device != bias.device:
        _fallback(f"bias_gelu with x {x.dtype} on {x.device}, bias {bias.dtype} on {bias.device}")
        return bias_gelu_reference(x, bias)
    return BiasGelu.apply(x, bias)


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y through the peerline kernels (torch for unsupported dtypes or broadcasting shapes)."""
    if not _supported(x, y) or x.shape != y.shape or x.device != y.device:
        _fallback(f"residual_add with x {x.dtype}{tuple(x.shape)}, y {y.dtype}{tuple(y.shape)}")
        return residual_add_reference(x, y)
    return ResidualAdd.apply(x, y)


# ---- --kernels auto: peerline's kernel or torch's op, per launch ----

# (op, dtypes, elements, hidden, device, eager) -> True for peerline's kernel
_CHOICES: dict[tuple, bool] = {}


def _eager_always_torch(op: str, dtype: torch.dtype, dev: int) -> bool:
    """Cached in _CHOICES (which tests reset with the card table): card_table.CardTable.eager_always_torch for
    `op` on `dtype` on device `dev`; False for a dtype the kernels do not take (the caller's checks decide)."""
    key = (op, "eager always torch", dtype, dev)
    hit = _CHOICES.get(key)
    if hit is None:
        name = _DTYPES.get(dtype)
        hit = _remember(_CHOICES, key, name is not None and card_table(dev).eager_always_torch(op, _SHORT[name]))
    return hit


def _chosen(key: tuple, op: str, dtype: torch.dtype, nbytes: int, dev: int, eager: bool, ops: tuple[str, ...]) -> bool:
    """Cached: peerline's kernel only where the card's table picks it for every op of `ops` (card_table.CardTable.pick:
    torch where it is faster on this card at this size, and for eager launches below the op's threshold)."""
    hit = _CHOICES.get(key)
    if hit is None:
        table = card_table(dev)
        short = _SHORT[_DTYPES[dtype]]
        scale = {"bias_gelu_fwd": 1.0, "bias_gelu_bwd": 1.5, "residual_add": 1.0}
        hit = _remember(_CHOICES, key, all(table.pick(o, short, int(nbytes * scale[o]), eager) == PEERLINE
                                           for o in ops))
    return hit


def auto_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bias_gelu for --kernels auto: the kernel where the card's table says it wins, torch's ops elsewhere."""
    if not _supported(x, bias) or x.device != bias.device or bias.dim() != 1 or x.dim() == 0:
        return bias_gelu(x, bias)  # the checks and the fallback of the explicit path
    if _bias_gelu_pick(x.dtype, bias.dtype, x.numel(), x.shape[-1], x.get_device(), not capturing()):
        return BiasGelu.apply(x, bias)
    return bias_gelu_reference(x, bias)


def eager_bias_gelu_on_torch(dtype: torch.dtype, bias_dtype: torch.dtype, n: int, width: int, dev: int) -> bool:
    """--kernels auto, an eager launch: whether gelu(x + bias) of an n-element x [..., width] of `dtype` runs as
    torch's ops here (the caller may then add the bias in its GEMM's epilogue instead)."""
    if dtype not in _DTYPES or bias_dtype not in _DTYPES:
        return True
    return not _bias_gelu_pick(dtype, bias_dtype, n, width, dev, True)


def _bias_gelu_pick(dtype: torch.dtype, bias_dtype: torch.dtype, n: int, width: int, dev: int, eager: bool) -> bool:
    """Whether the kernels take this launch (card_table's pick for both passes, cached). An eager launch that
    turns to torch still builds the kernels a captured launch of the same size would use (compiling inside a graph
    capture is not allowed)."""
    key = ("bias_gelu", dtype, bias_dtype, n, width, dev, eager)
    nbytes = 2 * n * dtype.itemsize
    ops = ("bias_gelu_fwd", "bias_gelu_bwd")
    if _chosen(key, "bias_gelu", dtype, nbytes, dev, eager, ops):
        return True
    if eager and n and _chosen(key[:-1] + (False,), "bias_gelu", dtype, nbytes, dev, False, ops):
        _warm(key, lambda: (prepare_bias_gelu_forward(dtype, bias_dtype, n, width, 0, 0, -1, dev),
                            prepare_bias_gelu_backward(dtype, bias_dtype, n, width, 0, 0, 0, -1, dev)))
    return False


def _residual_add_chosen(xt: torch.dtype, yt: torch.dtype, n: int, dev: int, eager: bool) -> bool:
    """Cached: the card's pick of the kernel for an n-element x + y, eager or captured (_chosen)."""
    nbytes = n * (xt.itemsize + yt.itemsize + torch.promote_types(xt, yt).itemsize)
    return _chosen(("residual_add", xt, yt, n, 0, dev, eager), "residual_add", xt, nbytes, dev, eager,
                   ("residual_add",))


def eager_residual_add_on_torch(x_dtype: torch.dtype, y_dtype: torch.dtype, n: int, dev: int) -> bool:
    """--kernels auto, an eager launch: whether x + y of n elements runs torch's add here whatever the tensors'
    layout (the card's pick at this size is torch). It builds the kernels a captured launch of the same size would
    use."""
    if _eager_always_torch("residual_add", x_dtype, dev):
        return True
    if x_dtype not in _DTYPES or y_dtype not in _DTYPES:
        return True
    if _residual_add_chosen(x_dtype, y_dtype, n, dev, True):
        return False
    if n and _residual_add_chosen(x_dtype, y_dtype, n, dev, False):
        _warm(("residual_add", x_dtype, y_dtype, n, 0, dev, True),
              lambda: prepare_residual_add(x_dtype, y_dtype, n, 0, 0, -1, dev))
    return True


def auto_residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """residual_add for --kernels auto (see auto_bias_gelu). An eager call where the card sends every launch of
    this dtype to torch (eager_always_torch) goes straight to torch's add: one cached lookup, no size checks."""
    eager = not capturing()
    if eager and x.is_cuda and _eager_always_torch("residual_add", x.dtype, x.get_device()):
        return residual_add_reference(x, y)
    if not _supported(x, y) or x.shape != y.shape or x.device != y.device:
        return residual_add_reference(x, y)
    n, dev = x.numel(), x.get_device()
    on_kernel = (not eager_residual_add_on_torch(x.dtype, y.dtype, n, dev) if eager
                 else _residual_add_chosen(x.dtype, y.dtype, n, dev, False))
    return ResidualAdd.apply(x, y) if on_kernel else residual_add_reference(x, y)


_warmed: set[tuple] = set()


def _warm(key: tuple, build: Any) -> None:
    """Build (compile and load) the kernels of a launch once, outside any capture."""
    if key not in _warmed:
        _warmed.add(key)
        build()

