"""GPU tests of the warp-specialized elementwise kernels against float64 torch.

Fresh random inputs per case; every output and workspace is filled with NaN before the launch (elementwise.
POISON_OUTPUTS and `out=`), so an element the kernel never writes fails. Error bound per METHOD.md ("Correct
first"): relative error norm ||out - ref|| / ||ref|| against float64 on the same (upcast) inputs; fp32 results
far under 1e-3 (we ask 1e-5), bf16 results between 1e-3 and 1e-2 (we ask 6e-3); NaN never passes. fp32 GELU
results are also bounded per element (ELEM_BOUND): the fp32 Phi is an approximation (phi_cdf_acc), and a norm over
millions of elements could hide a bad region of v.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
cupy = pytest.importorskip("cupy")

from peerline.kernels import elementwise as ew  # noqa: E402
from peerline.kernels import ops  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
BOUND = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
# Per element, fp32 results of bias+GELU: |out - ref| <= 2e-6 |ref| (backward: relative to its terms). Why 2e-6:
# the float32 model of phi_cdf_acc (kernels/fit_phi.py acc_errors, CPU test) is within 5.4e-7 of float64 over
# |v| <= 10, MUFU.RCP / MUFU.EX2 add <= 3 ulp (3.6e-7), normcdff (scalar paths, PL_GELU 0) is 5 ulp (6e-7); the
# grad's product with g one rounding more; 2e-6 leaves 2x for the model's fma double rounding and the
# compiler's own fma contractions. A regression of the fit (or a normcdff-free 1 + erff) fails here first.
ELEM_BOUND = 2e-6
# Below this |ref| the comparison is absolute (|out - ref| <= 2e-6 x 1e-30): the fp32 GELU's left tail, v < -11.4.
# There exp(-v^2/2) comes from ex2.approx.ftz, which flushes below 2^-126 (|v| > 13.2): results of at most ~4e-39
# (denormal in fp32, as torch's own would be) come out 0, which a relative check would call an error of 1.
ELEM_TINY = 1e-30
# bias-gradient sums are fp32 sums of fp32 products: only the sum's rounding (and the output dtype's)
BIAS_BOUND = {torch.float32: 2e-5, torch.bfloat16: 6e-3}

SHAPES = [(1, 1), (1, 7), (3, 5), (2, 8), (5, 1000), (33, 4096), (7, 8193), (2, 3, 777), (1024, 1536),
          (4096, 4096), (513, 24)]


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ew, "POISON_OUTPUTS", True)


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||out - ref|| / ||ref|| (or / ||scale||: the magnitude an fp32 evaluation is accurate relative to)."""
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"non-finite output ({(~torch.isfinite(out64)).sum().item()} elements)"
    denom = (ref if scale is None else scale).norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


def max_elem_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |out - ref| / max(|scale|, ELEM_TINY) over all elements (scale defaults to ref)."""
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"non-finite output ({(~torch.isfinite(out64)).sum().item()} elements)"
    den = (ref if scale is None else scale).abs().clamp_min(ELEM_TINY)
    return ((out64 - ref).abs() / den).max().item() if ref.numel() else 0.0


def randn(shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values; `offset` > 0 gives a contiguous view that starts `offset` elements into its buffer
    (misaligned for offset 1)."""
    n = math.prod(shape)
    buf = (torch.randn(n + offset, device=DEV) * scale).to(dtype)
    return buf[offset:].view(shape)


def v32(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x + b as the kernels form it: one correctly rounded fp32 add (as torch's fp32 x + b), in float64.

    The reference evaluates GELU in float64 at this value rather than at the exact x + b: GELU's condition number
    is ~v^2 in the left tail (~30 at v = -5.5), so the add's half-ulp rounding alone moves an fp32 result by up
    to ~2e-6 relative, whatever the GELU evaluation; on a one-element tensor that is the whole norm (the first
    GPU run's (1, 1) cases). What the tests bound is the kernels' GELU, and that stays exact to a few ulp."""
    return (x.float() + b.float()).double()


def gelu64(v: torch.Tensor) -> torch.Tensor:
    # erfc, not 1 + erf: in float64, 1 + erf(v / sqrt 2) cancels for v << 0 (relative error 0.1 at v = -8, exactly
    # 0 below v = -8.3), which a per-element check would blame on the kernel
    return 0.5 * v * torch.special.erfc(-v / math.sqrt(2))


def gelu_pdf64(v: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)


def gelu_grad64(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.special.erfc(-v / math.sqrt(2)) + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)


def poisoned_like(shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
    n = math.prod(shape)
    return torch.full((n + offset,), float("nan"), dtype=dtype, device=DEV)[offset:].view(shape)


DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("xdt,bdt", DTYPE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xoff,boff", [(0, 0), (1, 0), (0, 1), (3, 1)])
def test_bias_gelu_forward(shape: tuple[int, ...], xdt: torch.dtype, bdt: torch.dtype, xoff: int, boff: int) -> None:
    x = randn(shape, xdt, xoff, scale=2.0)
    b = randn((shape[-1],), bdt, boff)
    y = ew.bias_gelu_forward(x, b)
    torch.cuda.synchronize()
    assert y.shape == x.shape and y.dtype == xdt
    ref = gelu64(v32(x, b))
    err = rel_err(y, ref)
    assert err < BOUND[xdt], f"rel err {err:.3g}"
    if xdt == torch.float32:
        elem = max_elem_err(y, ref)
        assert elem < ELEM_BOUND, f"max per-element rel err {elem:.3g}"


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (33, 4096), (7, 8193), (1024, 1536)])
@pytest.mark.parametrize("xoff,ooff", [(0, 1), (1, 0), (1, 1), (0, 0)])
def test_bias_gelu_forward_into_poisoned_out(shape: tuple[int, ...], xdt: torch.dtype, xoff: int, ooff: int) -> None:
    """Caller-provided NaN outputs, aligned differently from x (scalar path) or alike (vector path)."""
    x = randn(shape, xdt, xoff)
    b = randn((shape[-1],), torch.float32)
    out = poisoned_like(shape, xdt, ooff)
    ew.bias_gelu_forward(x, b, out=out)
    torch.cuda.synchronize()
    assert rel_err(out, gelu64(v32(x, b))) < BOUND[xdt]


@pytest.mark.parametrize("xdt,bdt", DTYPE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("goff,xoff", [(0, 0), (1, 1), (1, 0), (5, 5)])
def test_bias_gelu_backward(shape: tuple[int, ...], xdt: torch.dtype, bdt: torch.dtype, goff: int, xoff: int) -> None:
    """(1, 1) and (5, 5): same misalignment -> vector path with a scalar head; (1, 0) -> scalar kernel."""
    x = randn(shape, xdt, xoff, scale=2.0)
    g = randn(shape, xdt, goff)
    b = randn((shape[-1],), bdt)
    gx, gb = ew.bias_gelu_backward(g, x, b)
    torch.cuda.synchronize()
    assert gx.dtype == xdt and gb.dtype == bdt and gb.shape == b.shape
    v = v32(x, b)
    prod = g.double() * gelu_grad64(v)
    # gelu' = Phi(v) + v phi(v) crosses 0 at v = -0.7518: there an fp32 sum is only accurate relative to its
    # terms, eps (Phi + |v| phi), not to the (tiny) result; scale the norm by that (>= |gelu'|, about the same
    # size over a normal sample, so large tensors are bounded as before; one element near the root is not a bug)
    terms = g.double().abs() * (0.5 * torch.special.erfc(-v / math.sqrt(2)) + v.abs() * gelu_pdf64(v))
    assert rel_err(gx, prod, scale=terms) < BOUND[xdt]
    if xdt == torch.float32:
        elem = max_elem_err(gx, prod, scale=terms)
        assert elem < ELEM_BOUND, f"max per-element rel err (to the terms) {elem:.3g}"
    err_b = rel_err(gb, prod.reshape(-1, shape[-1]).sum(0))
    assert err_b < BIAS_BOUND[bdt], f"bias grad rel err {err_b:.3g}"


@pytest.mark.parametrize("gelu", [1, 3, 0])  # compile.GELU_FAST (default), GELU_ACC, GELU_EXACT (normcdff)
def test_fp32_gelu_dense_grid(monkeypatch: pytest.MonkeyPatch, gelu: int) -> None:
    """fp32 bias+GELU forward and backward on a dense grid of v (about 2^20 points over [-20, 12], the left tail
    down to where Phi is denormal), per element against float64: the GPU's own rcp/ex2 approximations included,
    which the CPU model of phi_cdf_acc (tests/unit/test_kernels_gelu.py) can only bound from their documentation."""
    monkeypatch.setattr(ew, "TUNING", {"gelu": gelu})
    h = 1024
    x = torch.linspace(-20.0, 12.0, 1024 * h + 7, device=DEV)[7:].view(-1, h)
    b = randn((h,), torch.float32, scale=0.01)
    g = randn(tuple(x.shape), torch.float32)
    v = v32(x, b)
    ref = gelu64(v)
    y = ew.bias_gelu_forward(x, b)
    assert rel_err(y, ref) < BOUND[torch.float32]
    elem = max_elem_err(y, ref)
    assert elem < ELEM_BOUND, f"gelu {gelu}: max per-element rel err {elem:.3g}"
    gx, _ = ew.bias_gelu_backward(g, x, b)
    prod = g.double() * gelu_grad64(v)
    terms = g.double().abs() * (0.5 * torch.special.erfc(-v / math.sqrt(2)) + v.abs() * gelu_pdf64(v))
    elem = max_elem_err(gx, prod, scale=terms)
    assert elem < ELEM_BOUND, f"gelu {gelu}: backward max per-element rel err (to the terms) {elem:.3g}"


def test_bias_gelu_backward_is_deterministic() -> None:
    x, g = randn((4096, 3072), torch.bfloat16), randn((4096, 3072), torch.bfloat16)
    b = randn((3072,), torch.float32)
    first = ew.bias_gelu_backward(g, x, b)
    second = ew.bias_gelu_backward(g, x, b)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


RES_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
              (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("xdt,ydt", RES_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xoff,yoff", [(0, 0), (1, 1), (1, 0), (0, 3)])
def test_residual_add(shape: tuple[int, ...], xdt: torch.dtype, ydt: torch.dtype, xoff: int, yoff: int) -> None:
    x, y = randn(shape, xdt, xoff), randn(shape, ydt, yoff)
    out = ew.residual_add_forward(x, y)
    torch.cuda.synchronize()
    rdt = torch.result_type(x, y)
    assert out.dtype == rdt and out.shape == x.shape
    # one fp32 add, rounded once: bit-identical to torch's own x + y
    assert torch.equal(out, x + y)
    assert rel_err(out, x.double() + y.double()) < BOUND[rdt]


def test_residual_add_into_poisoned_misaligned_out() -> None:
    x, y = randn((37, 1001), torch.float32), randn((37, 1001), torch.bfloat16)
    out = poisoned_like((37, 1001), torch.float32, 1)
    ew.residual_add_forward(x, y, out=out)
    assert torch.equal(out, x + y)


@pytest.mark.parametrize("xdt,bdt", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_autograd_through_ops(xdt: torch.dtype, bdt: torch.dtype) -> None:
    """ops.bias_gelu / residual_add with impl="peerline": the value and every gradient vs float64."""
    x = randn((64, 4096), xdt).requires_grad_()
    b = randn((4096,), bdt).requires_grad_()
    r = randn((64, 4096), torch.float32).requires_grad_()
    gz = randn((64, 4096), torch.float32)
    z = ops.residual_add(r, ops.bias_gelu(x, b, "peerline"), "peerline")
    z.backward(gz)
    v = v32(x.detach(), b.detach())
    # the gradient reaching bias_gelu is gz in y's dtype (x's): the residual add's backward casts it
    gy = gz.to(xdt).double()
    prod = gy * gelu_grad64(v)
    assert z.dtype == torch.float32
    assert rel_err(z, r.detach().double() + gelu64(v)) < BOUND[xdt]
    assert rel_err(x.grad, prod) < BOUND[xdt]
    assert rel_err(b.grad, prod.sum(0)) < BIAS_BOUND[bdt]
    assert torch.equal(r.grad, gz)


def test_cuda_graph_capture_fwd_bwd() -> None:
    """Capture forward + backward, replay on fresh inputs copied into the static buffers, compare to float64."""
    shape, h = (96, 3000), 3000
    x = randn(shape, torch.bfloat16).requires_grad_()
    b = randn((h,), torch.float32).requires_grad_()
    r = randn(shape, torch.float32)
    gz = randn(shape, torch.float32)

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = ew.residual_add(r, ew.bias_gelu(x, b))
        gx, gb = torch.autograd.grad(z, (x, b), grad_outputs=gz)
        return z, gx, gb

    for _ in range(2):  # warm-up: compile and load the kernels before capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        z, gx, gb = step()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn(shape, device=DEV))
            b.copy_(torch.randn(h, device=DEV))
            r.copy_(torch.randn(shape, device=DEV))
            gz.copy_(torch.randn(shape, device=DEV))
            for t in (z, gx, gb):
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        v = v32(x.detach(), b.detach())
        prod = gz.bfloat16().double() * gelu_grad64(v)  # the residual add hands bias_gelu gz in bf16
        assert rel_err(z, r.double() + gelu64(v)) < BOUND[torch.bfloat16]
        assert rel_err(gx, prod) < BOUND[torch.bfloat16]
        assert rel_err(gb, prod.sum(0)) < BIAS_BOUND[torch.float32]


def test_launches_on_current_stream() -> None:
    """Work issued on a side stream is ordered by that stream: the result is right without a device sync."""
    from peerline.distributed.streams import create_rank_streams

    side = create_rank_streams(DEV).compute
    x, b = randn((2048, 4096), torch.bfloat16), randn((4096,), torch.float32)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ew.bias_gelu_forward(x, b)
        ref = torch.nn.functional.gelu(x.float() + b)
        diff = (y.float() - ref).abs().max()
    side.synchronize()
    assert diff.item() < 0.05


def test_kernel_attributes_and_sass(tmp_path) -> None:
    """Resources as loaded, and LDGSTS (and 16-byte shared loads / global stores) in the SASS of pl_main (needs
    nvcc + cuobjdump, as the GPU machine has; test_kernels_tools_gpu.py checks every spec)."""
    from peerline.bench.kernel_tools import inspect_sass
    from peerline.kernels import compile as kc
    spec = kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16")
    op = kc.get_op(spec, DEV.index)
    assert op.blocks_per_sm >= 2 and op.attributes["local_bytes"] == 0, op.attributes
    nvcc, cuobjdump = inspect_sass.find_tool("nvcc"), inspect_sass.find_tool("cuobjdump")
    if not nvcc or not cuobjdump:
        pytest.skip("nvcc/cuobjdump not found")
    major, minor = torch.cuda.get_device_capability(DEV)
    rep = inspect_sass.inspect(spec, nvcc, cuobjdump, f"sm_{major}{minor}", tmp_path)
    main = rep["functions"]["pl_main"]
    assert main["LDGSTS"] > 0 and main["LDS.128"] > 0 and main["LDL/STL"] == 0, main


# Non-default launch plans, each through the same float64-referenced checks (odd sizes, misaligned views, a scalar
# head and tail, NaN-poisoned outputs, bf16 and fp32, grids of 2 blocks that wrap their stages many times):
#   w4.s3.d1.v2        direct stores from the compute warps, 32-byte chunks, 3 stages, 4 compute warps
#   w8.s4.d1.l1        the bulk loader (cp.async.bulk per tile on mbarriers) with direct stores
#   w8.s2.l1           the bulk loader with the storer warp (out_pipe)
#   w4.s8.t256.d1.l1   the bulk loader with 8 stages (the parity of each stage's barriers flips many times)
#   w16.s3.d1          16 compute warps (576 threads)
#   w12.s2.d1          12 compute warps, tile 384 chunks (not a power of two)
#   w8.s3.l1.o1        TMA both ways: bulk loader and bulk (cp.async.bulk shared->global) stores from the storer
#   .h1 / .h2          cache hints (streaming stores; evict-first bulk loads)
#   w4.s4.t256.d1.l1.h1.r2   the residual add default with at most 2 tiles per block (.r: a grid of ntiles / 2
#                      blocks; with grid_cap 2 the resident part is 2 blocks but the grid still grows to ntiles / 2)
#   w16.s3.t1024.d1.l1.r3.p1 the bf16 forward default with at most 3 tiles per block and phi_cdf_lite (.p1: the
#                      forward's bf16 results through a degree-3 P; fp32 results and the backward as the default)
OTHER_PLANS = ["w4.s3.d1.v2", "w8.s4.d1.l1", "w8.s2.l1", "w4.s8.t256.d1.l1", "w16.s3.d1", "w12.s2.d1",
               "w8.s3.l1.o1", "w4.s4.t256.d1.l1.h2", "w8.s3.d1.h1", "w4.s4.t256.d1.l1.h1.r2",
               "w16.s3.t1024.d1.l1.r3.p1"]


@pytest.fixture(scope="module")
def _other_plans_compiled() -> None:
    """NVRTC-compile every (plan, op, dtype) of OTHER_PLANS in parallel processes first (CuPy's disk cache), so the
    tests below load cubins instead of compiling ~42 specs one after another."""
    import os

    from peerline.kernels import compile as kc
    from peerline.kernels import plan

    specs = []
    for label in OTHER_PLANS:
        t = plan.parse_plan(label).spec_fields()
        for d in ("bfloat16", "float32"):
            specs += [kc.KernelSpec(kc.OP_BIAS_GELU_FWD, d, bias="float32", **t),
                      kc.KernelSpec(kc.OP_BIAS_GELU_BWD, d, bias="float32", **t),
                      kc.KernelSpec(kc.OP_RESIDUAL_ADD, d, y=d, out=d, **t)]
    kc.warm_compile(specs, DEV.index, min(8, os.cpu_count() or 1))


@pytest.mark.parametrize("label", OTHER_PLANS)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grid_cap", [0, 2])  # 2 blocks: every block wraps its pipeline stages many times
@pytest.mark.parametrize("shape,off", [((37, 1001), 1), ((64, 4096), 0), ((7, 8193), 3)])
def test_other_launch_plan(monkeypatch: pytest.MonkeyPatch, _other_plans_compiled: None, label: str,
                           dt: torch.dtype, shape: tuple[int, ...], off: int, grid_cap: int) -> None:
    from peerline.kernels import plan

    tuning = {**plan.parse_plan(label).tuning(), "grid_cap": grid_cap}
    monkeypatch.setattr(ew, "TUNING", tuning)
    x, g = randn(shape, dt, off, scale=2.0), randn(shape, dt, off)
    b = randn((shape[-1],), torch.float32)
    v = v32(x, b)
    y, ref = ew.bias_gelu_forward(x, b), gelu64(v)
    assert rel_err(y, ref) < BOUND[dt]
    gx, gb = ew.bias_gelu_backward(g, x, b)
    prod = g.double() * gelu_grad64(v)
    terms = g.double().abs() * (0.5 * torch.special.erfc(-v / math.sqrt(2)) + v.abs() * gelu_pdf64(v))
    assert rel_err(gx, prod, scale=terms) < BOUND[dt]
    if dt == torch.float32:
        assert max_elem_err(y, ref) < ELEM_BOUND
        assert max_elem_err(gx, prod, scale=terms) < ELEM_BOUND
    assert rel_err(gb, prod.reshape(-1, shape[-1]).sum(0)) < BIAS_BOUND[torch.float32]
    assert torch.equal(ew.residual_add_forward(x, g), x + g)
    out = poisoned_like(shape, dt, off)  # caller's NaN output with the inputs' misalignment: the vector path
    ew.residual_add_forward(x, g, out=out)
    assert torch.equal(out, x + g)


@pytest.mark.parametrize("label,rounds_op", [("w4.s4.t256.d1.l1.h1.r2", "res"), ("w16.s3.t1024.d1.l1.r1.p1", "fwd"),
                                             ("w12.s4.d1.r2", "fwd")])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_rounds_grid_beyond_resident(monkeypatch: pytest.MonkeyPatch, label: str, rounds_op: str,
                                     dt: torch.dtype) -> None:
    """Plans with rounds (.r) launch more blocks than fit at once (blocks queue for SMs; each walks at most r
    tiles), on a misaligned 33.5 M-element view with a scalar head and tail, NaN-poisoned outputs: exact residual
    sums and the float64-bounded forward. The launch's grid is recorded, so a plumbing regression back to the
    persistent grid fails here; the backward keeps its persistent grid whatever the plan says."""
    from peerline.kernels import compile as kc
    from peerline.kernels import plan

    p = plan.parse_plan(label)
    # the residual add runs pl_flat unless the engine is asked for
    monkeypatch.setattr(ew, "TUNING", {**p.tuning(), **({"engine": 1} if rounds_op == "res" else {})})
    grids: list[tuple[int, int]] = []  # (grid, threads) of every pl_main launch
    real_launch = ew.launch_kernel

    def spy(item: ew.Launch, stream: int) -> None:
        if item.smem > 0:  # pl_main (the scalar and reduce kernels use no dynamic shared memory)
            grids.append((item.grid, item.block[0]))
        return real_launch(item, stream)

    monkeypatch.setattr(ew, "launch_kernel", spy)
    # 33.5 M elements: 4096-16384 tiles, so ntiles / r is plan.MIN_WAVES waves of resident blocks or more (a
    # shallower grid is the persistent one)
    shape, off = (8191, 4096), 1
    x, g = randn(shape, dt, off, scale=2.0), randn(shape, dt, off)
    if rounds_op == "res":
        spec = ew._spec(kc.OP_RESIDUAL_ADD, ew._DTYPES[dt], y=ew._DTYPES[dt], out=ew._DTYPES[dt])
        out = ew.residual_add_forward(x, g)
        assert torch.equal(out, x + g)
    else:
        b = randn((shape[-1],), torch.float32)
        spec = ew._spec(kc.OP_BIAS_GELU_FWD, ew._DTYPES[dt], bias="float32")
        ref = gelu64(v32(x, b))
        y = ew.bias_gelu_forward(x, b)
        assert rel_err(y, ref) < BOUND[dt]
        if dt == torch.float32:
            assert max_elem_err(y, ref) < ELEM_BOUND
        gx, _ = ew.bias_gelu_backward(g, x, b)  # runs, on the persistent grid (checked below)
        assert torch.isfinite(gx.float()).all()
    torch.cuda.synchronize()
    op = kc.get_op(spec, DEV.index)
    nchunks = (math.prod(shape) - plan.common_head([(x.data_ptr(), x.element_size())], spec.e)) // spec.e
    ntiles = -(-nchunks // spec.tile_chunks)
    assert grids[0] == (plan.vector_grid(ntiles, op.max_grid, p.rounds), spec.threads)
    assert grids[0][0] > op.max_grid, (grids, op.max_grid)  # more blocks than are resident at once
    if rounds_op == "fwd":  # the backward: its own op's persistent grid
        bwd = kc.get_op(ew._spec(kc.OP_BIAS_GELU_BWD, ew._DTYPES[dt], bias="float32"), DEV.index)
        assert len(grids) == 2 and grids[1][1] == bwd.spec.threads, grids
        assert grids[1][0] <= bwd.max_grid, (grids, bwd.max_grid)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_residual_add_one_pass_in_both_size_classes(monkeypatch: pytest.MonkeyPatch, dt: torch.dtype) -> None:
    """The residual add launches pl_flat, the one-pass kernel of its op's module, within the "l2" size class and
    beyond it (plan.in_l2), exact on misaligned, NaN-poisoned views with scalar heads and tails."""
    from peerline.kernels import compile as kc
    from peerline.kernels import plan

    name = ew._DTYPES[dt]
    flats = {l2: kc.get_op(ew._spec(kc.OP_RESIDUAL_ADD, name, l2=l2, device_index=DEV.index, y=name, out=name),
                           DEV.index).flat for l2 in (True, False)}
    assert all(f is not None for f in flats.values())
    launched: list[tuple[object, tuple[int, int], int]] = []
    real_launch = ew.launch_kernel

    def spy(item: ew.Launch, stream: int) -> None:
        launched.append((item.kernel.raw, item.block, item.grid))
        return real_launch(item, stream)

    monkeypatch.setattr(ew, "launch_kernel", spy)
    l2_bytes = ew._l2_bytes(DEV.index)
    moved = 3 * dt.itemsize  # bytes per element: x and y read, the sum written
    limit = int(plan.L2_FRACTION * l2_bytes) // moved  # elements at the edge of the "l2" size class
    for rows, in_l2 in ((max(3, limit // 2 // 4096), True), (limit // 4096 + 7, False)):
        x, y = randn((rows, 4096), dt, 1), randn((rows, 4096), dt, 1)
        assert plan.in_l2(x.numel() * moved, l2_bytes) == in_l2
        out = ew.residual_add_forward(x, y)
        assert torch.equal(out, x + y)
        raw, block, grid = launched[-1]
        assert raw is flats[in_l2] and block == (ew.FLAT_THREADS, 1), (rows, in_l2)
        e = 16 // dt.itemsize
        head = plan.common_head([(x.data_ptr(), dt.itemsize), (y.data_ptr(), dt.itemsize)], e)
        assert head > 0 and grid == -(-((x.numel() - head) // e) // ew.FLAT_THREADS), (grid, head)
