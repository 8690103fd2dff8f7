"""CPU tests of the kernel ops: dispatch, resolve_impl, references, launch planning (no CUDA needed)."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels import compile as kc
from peerline.kernels import ops, plan

pytestmark = pytest.mark.timeout(60)


def test_resolve_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    real_find_spec = ops.importlib.util.find_spec
    monkeypatch.setattr(ops.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "cupy" else real_find_spec(name, *a))
    assert ops.resolve_impl("auto", cpu) == "torch"
    assert ops.resolve_impl("peerline", cpu) == "torch"  # the CPU always uses torch
    assert ops.resolve_impl("torch", cpu) == "torch"
    assert ops.resolve_impl("auto", cuda) == "auto"  # the per-launch choice (card table)
    assert ops.resolve_impl("torch", cuda) == "torch"
    assert ops.resolve_impl("peerline", cuda) == "peerline"
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        ops.resolve_impl("triton", cpu)
    # without CuPy, auto means torch on a GPU too
    monkeypatch.setattr(ops.importlib.util, "find_spec", lambda name, *a: None)
    assert ops.resolve_impl("auto", cuda) == "torch"
    assert ops.resolve_impl("peerline", cuda) == "peerline"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_reference_is_exact_gelu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 37, generator=g).to(dtype)
    b = torch.randn(37, generator=g)
    want = F.gelu(x + b.to(dtype), approximate="none")
    for impl in ("torch", "peerline"):  # peerline on a CPU tensor runs the reference
        assert torch.equal(ops.bias_gelu(x, b, impl), want)
    # and gelu is the erf one: 0.5 v (1 + erf(v / sqrt 2)), against float64
    v = x.double() + b.to(dtype).double()
    ref = 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))
    got = ops.bias_gelu_reference(x, b).double()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((got - ref).norm() / ref.norm()).item() < tol


def test_residual_add_reference_promotes() -> None:
    x = torch.randn(3, 8)
    y = torch.randn(3, 8).bfloat16()
    for impl in ("torch", "peerline"):
        out = ops.residual_add(x, y, impl)
        assert out.dtype == torch.float32
        assert torch.equal(out, x + y.float())


def test_reference_backward_matches_float64() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(4, 9, generator=g, dtype=torch.float64)
    ops.bias_gelu(x, b, "peerline").backward(gy)
    v = (x + b).detach()
    d = 0.5 * (1 + torch.erf(v / math.sqrt(2))) + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
    assert torch.allclose(x.grad, gy * d)
    assert torch.allclose(b.grad, (gy * d).sum(0))


def test_elementwise_module_imports_without_cupy() -> None:
    code = "import sys, peerline.kernels.elementwise, peerline.kernels.compile; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_common_head_and_output_offset() -> None:
    assert plan.common_head([(0x1000, 2)], 8) == 0
    assert plan.common_head([(0x1002, 2)], 8) == 7
    assert plan.common_head([(0x1002, 2), (0x1012, 2)], 8) == 7
    assert plan.common_head([(0x1002, 2), (0x1004, 2)], 8) is None  # misaligned differently
    # fp32 x offset by one element (4 bytes), bf16 y offset by one element (2 bytes): head 7 serves both
    assert plan.common_head([(0x1004, 4), (0x1002, 2)], 8) == 7
    for head in range(8):
        off = plan.output_offset(0x2000, 2, head)
        assert (0x2000 + (off + head) * 2) % 16 == 0
    off = plan.output_offset(0x2000, 4, 7)
    assert (0x2000 + (off + 7) * 4) % 16 == 0


def test_plan_vector_covers_everything() -> None:
    for n in (1, 7, 8, 9, 4095, 4096, 4097, 100_003):
        for head in (0, 3, 7):
            vp = plan.plan_vector(n, head, 8, 512, 100)
            if n - head < 8:
                assert vp is None
                continue
            assert vp.head + vp.nchunks * 8 == vp.tail_start <= n < vp.tail_start + 8
            assert vp.ntiles * 512 >= vp.nchunks > (vp.ntiles - 1) * 512
            assert 1 <= vp.grid <= 100
    assert plan.plan_vector(100, None, 8, 512, 10) is None


@pytest.mark.parametrize("hidden", [1, 3, 64, 1000, 1536, 4096, 8192, 8193, 16384])
def test_backward_grid_keeps_columns_fixed(hidden: int) -> None:
    tile_elems = 4096
    for ntiles in (1, 7, 5000):
        grid = plan.backward_grid(ntiles, hidden, tile_elems, 528)
        if grid is None:
            assert hidden // math.gcd(hidden, tile_elems) > 4 * 528
            continue
        assert (grid * tile_elems) % hidden == 0
        assert grid >= 1


def test_backward_grid_refuses_huge_partials() -> None:
    assert plan.backward_grid(10_000, 8191, 4096, 528) is None  # would need 8191 blocks
    threads = plan.scalar_backward_threads(10**7, 8191, 132 * 2048)
    assert threads % 8191 == 0 and threads >= 8191


@pytest.mark.parametrize("n,hidden,head", [(1000, 10, 3), (5000, 64, 0), (4099, 1000, 7), (777, 7, 5),
                                           (20000, 24, 1), (300, 512, 2)])
def test_partial_sum_layout_gives_column_sums(n: int, hidden: int, head: int) -> None:
    """The index algebra of the vector backward (slots fixed to columns, rows of H, shift by head) reproduces
    the plain column sums, for grids chosen by backward_grid."""
    rnd = random.Random(n + hidden)
    values = [rnd.uniform(-1, 1) for _ in range(n)]
    e, tile_elems = 8, 64  # a small tile so that several tiles per block occur
    ntiles = -(-((n - head) // e) // (tile_elems // e))
    grid = plan.backward_grid(ntiles, hidden, tile_elems, 64)
    assert grid is not None
    got = plan.simulate_bias_partials(n, hidden, head, e, tile_elems, grid, values)
    want = [sum(values[i] for i in range(c, n, hidden)) for c in range(hidden)]
    assert all(abs(a - b) < 1e-9 for a, b in zip(got, want))


def test_partial_sum_layout_breaks_with_a_bad_grid() -> None:
    """A grid that does not keep slots in one column must give wrong sums (the model can fail)."""
    n, hidden, head, e, tile_elems = 5000, 24, 0, 8, 64
    rnd = random.Random(0)
    values = [rnd.uniform(-1, 1) for _ in range(n)]
    got = plan.simulate_bias_partials(n, hidden, head, e, tile_elems, 5, values)  # 5 * 64 % 24 != 0
    want = [sum(values[i] for i in range(c, n, hidden)) for c in range(hidden)]
    assert max(abs(a - b) for a, b in zip(got, want)) > 1e-3


def test_kernel_specs() -> None:
    fwd = kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", bias="float32")
    assert (fwd.e, fwd.tile_chunks, fwd.smem_bytes) == (8, 512, 2 * 512 * 8 * 4)
    bwd = kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32")
    assert bwd.smem_bytes == 2 * 512 * 8 * 6
    res = kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="bfloat16", out="float32")
    assert (res.e, res.tile_chunks) == (8, 256)  # 80-byte chunks: smaller tiles
    assert "-DPL_TX=float" in res.defines() and "-DPL_TY=pl::bf16_t" in res.defines()
    with pytest.raises(ValueError, match="unsupported dtype"):
        kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float16")
    src = kc.source_text()
    assert '#include "ws_pipeline.cuh"' not in src and "cuda::memcpy_async" in src


@pytest.mark.parametrize("head", [None, 0, 1, 3])
def test_outputs_are_never_views(head: int | None) -> None:
    """Autograd forbids in-place writes to a view a custom Function returns (the first GPU run's CUDA-graph test):
    _new gives a base-less tensor in the requested shape, whose element `head` is 16-byte aligned."""
    from peerline.kernels import elementwise as ew

    t = ew._new((3, 5), torch.float32, torch.device("cpu"), head)
    assert t._base is None and t.shape == (3, 5) and t.is_contiguous()
    if head is not None:
        assert (t.data_ptr() + head * 4) % plan.VECTOR_BYTES == 0
    t.fill_(1.0)  # writable, and the whole padded storage stays alive through the tensor
    assert t.sum().item() == 15


def test_gelu_mode_reaches_the_compiler() -> None:
    assert "-DPL_GELU=1" in kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16").defines()  # the default: cheap Phi
    assert "-DPL_GELU=2" in kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", gelu=kc.GELU_FIRST).defines()
    with pytest.raises(ValueError, match="gelu mode"):
        kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", gelu=7)


_PHI_P = (0.2538924487501417, 0.253159813190026, 0.23974045749651607, 0.11135057033300631, 0.2682330378805142,
          -0.12634821285968728)  # elementwise.cu phi_cdf_fast, lowest power first


def _phi_fast32(v: torch.Tensor) -> torch.Tensor:
    """elementwise.cu phi_cdf_fast in fp32 torch ops (the GPU's MUFU rcp / ex2 differ by a few ulp)."""
    def c(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    t = 1.0 / (v.abs() * c(0.45 * 0.70710678118654752) + 1.0)
    p = t * c(0.5 * _PHI_P[5]) + c(0.5 * _PHI_P[4])
    for k in (3, 2, 1, 0):
        p = t * p + c(0.5 * _PHI_P[k])
    half_erfc = t * p * torch.exp2(v * v * c(-0.72134752044448170))
    return torch.where(v < 0, half_erfc, 1.0 - half_erfc)


def test_cheap_phi_is_far_inside_bf16_rounding() -> None:
    """The cheap GELU (bf16 results) against float64, per element over the whole range where gelu is a normal
    fp32: within 1e-4 relative (bf16's half-ulp is 2^-9 = 2e-3), so one-element bf16 tests cannot see it."""
    v = torch.linspace(-13, 10, 400001, dtype=torch.float32)
    g = (v * _phi_fast32(v)).double()
    v64 = v.double()
    ref = 0.5 * v64 * torch.special.erfc(-v64 / math.sqrt(2))
    nz = ref != 0
    assert ((g - ref).abs()[nz] / ref.abs()[nz]).max().item() < 1e-4
    # gelu' = Phi + v phi with phi from the same exp: accurate relative to its terms
    pdf = torch.exp(-0.5 * v64 * v64) / math.sqrt(2 * math.pi)
    grad = _phi_fast32(v).double() + v64 * 0.3989422804014327 * torch.exp2(v * v * -0.72134752044448170).double()
    phi = 0.5 * torch.special.erfc(-v64 / math.sqrt(2))
    assert ((grad - (phi + v64 * pdf)).abs() / (phi + v64.abs() * pdf)).max().item() < 1e-4


# elementwise.cu phi_cdf_lite (PL_GELU 4, plan field p1), lowest power first: fit_phi.fit(0.45, 4)
_PHI_LITE_P = (0.25408173810285867, 0.2539672082077663, 0.19834764859822462, 0.29437845665652956)


def _phi_lite32(v: torch.Tensor) -> torch.Tensor:
    """elementwise.cu phi_cdf_lite in fp32 torch ops."""
    def c(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    t = 1.0 / (v.abs() * c(0.45 * 0.70710678118654752) + 1.0)
    p = t * c(0.5 * _PHI_LITE_P[3]) + c(0.5 * _PHI_LITE_P[2])
    for k in (1, 0):
        p = t * p + c(0.5 * _PHI_LITE_P[k])
    half_erfc = t * p * torch.exp2(v * v * c(-0.72134752044448170))
    return torch.where(v < 0, half_erfc, 1.0 - half_erfc)


def test_lite_phi_literals_are_the_fit() -> None:
    """phi_cdf_lite's halved coefficients (highest power first) are _PHI_LITE_P, and that is what fit_phi's fit gives
    for p = 0.45 and 4 coefficients (to 1e-6: the Lawson iterations are deterministic in float64)."""
    import re

    src = (kc.KERNEL_DIR / kc.SOURCE).read_text()
    start = src.index("float phi_cdf_lite(float v)")
    body = src[start:src.index("\n}", start)]
    halves = [float(m) for m in re.findall(r"0\.5f \* (-?[0-9.e+-]+)f", body)]
    assert halves == [_PHI_LITE_P[3], *_PHI_LITE_P[2::-1]]
    assert "fmaf(fabsf(v), 0.45f * 0.70710678118654752f, 1.0f)" in body


def test_lite_phi_fit_error() -> None:
    from peerline.bench.kernel_tools import fit_phi
    coeffs, err = fit_phi.fit(0.45, 4, iters=200)
    assert err < 8e-4
    assert torch.allclose(coeffs, torch.tensor(_PHI_LITE_P, dtype=torch.float64), atol=1e-6)


def test_lite_gelu_error_bound_and_bf16_rounding() -> None:
    """gelu with phi_cdf_lite (bf16 forward results, plan p1) against float64: within 8e-4 relative per element over
    [-13, 10] (bf16's half-ulp is 2e-3 to 3.9e-3), and bf16 results of random inputs as the GPU tests draw them keep
    the norm error of correctly rounded results (1.66e-3, under the tests' 6e-3) to 1%."""
    v = torch.linspace(-13, 10, 400001, dtype=torch.float32)
    g = (v * _phi_lite32(v)).double()
    v64 = v.double()
    ref = 0.5 * v64 * torch.special.erfc(-v64 / math.sqrt(2))
    nz = ref != 0
    assert ((g - ref).abs()[nz] / ref.abs()[nz]).max().item() < 8e-4
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(400_000, generator=gen) * 2).bfloat16().float()
    vv = x + torch.randn(400_000, generator=gen)
    ref = 0.5 * vv.double() * torch.special.erfc(-vv.double() / math.sqrt(2))
    lite = (vv * _phi_lite32(vv)).bfloat16().double()
    rounded = ref.bfloat16().double()
    err_lite, err_rounded = ((lite - ref).norm() / ref.norm()).item(), ((rounded - ref).norm() / ref.norm()).item()
    assert err_lite < 1.01 * err_rounded < 6e-3, (err_lite, err_rounded)
