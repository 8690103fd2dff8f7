"""The fp32 GELU of elementwise.cu (phi_cdf_acc): its error bound from a float32 model, and the kernel's literals."""

from __future__ import annotations

import re

import pytest
import torch

from peerline.bench.kernel_tools import fit_phi
from peerline.kernels import compile as kc

pytestmark = pytest.mark.timeout(120)


def _acc_body() -> str:
    src = (kc.KERNEL_DIR / kc.SOURCE).read_text()
    start = src.index("float phi_cdf_acc(float v, float& e)")
    return src[start:src.index("\n}", start)]


def test_kernel_coefficients_are_the_fit() -> None:
    """The halved P coefficients in phi_cdf_acc are fit_phi.ACC_COEFFS (highest power first), p is ACC_P."""
    body = _acc_body()
    halves = [float(m) for m in re.findall(r"0\.5f \* (-?[0-9.e+-]+)f", body)]
    assert halves == [fit_phi.ACC_COEFFS[-1], *fit_phi.ACC_COEFFS[-2::-1]]
    assert f"fmaf(a, {fit_phi.ACC_P}f * 0.70710678118654752f, 1.0f)" in body
    assert f"fmaf(hi, {fit_phi._c_lo()!r}f, r)" in body


def test_fp32_gelu_model_error_bound() -> None:
    """The float32 model of phi_cdf_acc against float64 over |v| <= 10 (dense grid, both tails): the numbers
    docs/benchmarks/kernels-history.md records (gelu 5.4e-7, Phi 5.0e-7, exp 1.2e-7, gelu' 4.5e-7 relative to its
    terms); the GPU adds at most 3 ulp of MUFU error, so every fp32 result stays under 1e-6."""
    err = fit_phi.acc_errors(10.0, 400_001)
    assert err["gelu"] < 6e-7 and err["Phi"] < 6e-7, err
    assert err["exp"] < 1.5e-7, err
    assert err["gelu_grad"] < 6e-7, err


def test_fp32_model_tails_are_finite_and_ordered() -> None:
    """Beyond the grid: no NaN for huge |v| (the clamp at 20), Phi in [0, 1], 0 in the far left tail."""
    v = torch.tensor([-1e30, -40.0, -20.0, -13.5, 13.5, 40.0, 1e30], dtype=torch.float32)
    phi, e = fit_phi.model_acc32(v)
    assert torch.isfinite(phi).all() and torch.isfinite(e).all()
    assert ((phi >= 0) & (phi <= 1)).all()
    assert phi[0] == 0 and phi[-1] == 1


def test_gelu_modes_per_result_type() -> None:
    """PL_GELU reaches the compiler for every mode; the default (1) is the accurate fit for fp32 results."""
    for mode in (kc.GELU_EXACT, kc.GELU_FAST, kc.GELU_FIRST, kc.GELU_ACC, kc.GELU_LITE):
        assert f"-DPL_GELU={mode}" in kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32", gelu=mode).defines()
    src = (kc.KERNEL_DIR / kc.SOURCE).read_text()
    # GELU_LITE (4): bf16 results get MODE 4 (phi_cdf_lite), fp32 results the accurate fit like the default
    assert "return bytes == 2 ? PL_GELU : (PL_GELU == 1 || PL_GELU == 3 || PL_GELU == 4 ? 3 : 0);" in src
    assert "else if constexpr (MODE == 4) return phi_cdf_lite(v);" in src
