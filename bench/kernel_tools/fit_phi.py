"""Fits and checks the Phi approximations of elementwise.cu: erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z).

Two fits, both by weighted least squares on erfcx(z) / t with Lawson re-weighting (relative error), in float64:
  phi_cdf_fast (bf16 results): p = 0.45, P of degree 5, max 2.8e-5 relative on erfc;
  phi_cdf_acc  (fp32 results): p = 0.4,  P of degree 8, max 1.3e-7 relative on erfc (ACC_P, ACC_COEFFS below).

`python -m peerline.bench.kernel_tools.fit_phi` (offline, tens of seconds on a CPU) prints the fits and then the
error bound of the fp32 kernel formula: `model_acc32` evaluates phi_cdf_acc operation by operation in float32
(each add, mul and fma rounded once, as the GPU does; rcp.approx and ex2.approx modelled as correctly rounded),
and `acc_errors` measures it in float64 against erfc over a dense grid of v (tails included, |v| <= 10). The
hardware's MUFU approximations add at most their documented error on top (rcp.approx.f32: 1 ulp; ex2.approx.f32:
2 ulp), i.e. < 3.6e-7 relative, which the recorded bound (docs/benchmarks/kernels-history.md) includes.
"""

from __future__ import annotations

import argparse
import math

import torch

# phi_cdf_acc (elementwise.cu): t = 1 / (1 + ACC_P |v| / sqrt 2); P's coefficients, lowest power first (the kernel
# holds them halved, Phi = erfc / 2). tests/unit/test_kernels_gelu.py checks that the kernel's literals match.
ACC_P = 0.4
ACC_COEFFS = (0.22567586191585753, 0.22566960249285803, 0.2078425628500767, 0.16854340181834646,
              0.1414245264182734, -0.005589969411778523, 0.1690612871201941, -0.1828845096544581,
              0.05025735994305048)
# -log2(e) / 2 as a float32 plus the float32 of what is left (so that x * (C_HI + C_LO) is exact to ~2^-48)
C_HI = -0.72134752044448170
LN2 = 0.69314718055994531


def fit(p: float, deg: int, iters: int = 200) -> tuple[torch.Tensor, float]:
    """Coefficients of P and the max relative error of t P(t) against erfcx(z) over t in (1e-5, 1]."""
    t = torch.linspace(1e-5, 1.0, 40000, dtype=torch.float64)
    z = (1 / t - 1) / p
    g = torch.special.erfcx(z) / t
    a = torch.stack([t**k for k in range(deg)], 1) / g[:, None]  # rows scaled: relative residuals
    w = torch.ones_like(t)
    r = torch.zeros_like(t)
    c = torch.zeros(deg, dtype=torch.float64)
    for _ in range(iters):
        c = torch.linalg.lstsq(a * w[:, None], w[:, None]).solution[:, 0]
        r = a @ c - 1
        w = w * (r.abs() / r.abs().max() + 1e-3) ** 0.5
        w = w / w.mean()
    return c, r.abs().max().item()


# ---- float32 emulation of phi_cdf_acc ----

def _f(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fmaf: the product is exact in float64 (48 bits), the sum rounded to float64 then to float32 (a double
    rounding the GPU's single rounding avoids: at most 1 ulp of float32 apart, and rarely)."""
    return (a.double() * b.double() + c.double()).float()


def _c_lo() -> float:
    """The float32 of (-log2(e) / 2 - C_HI rounded to float32), the constant's own rounding."""
    exact = -0.5 / math.log(2.0)
    return float(torch.tensor(exact - float(_f(C_HI)), dtype=torch.float32))


def model_acc32(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Phi(v), e = exp(-v^2 / 2)) as phi_cdf_acc forms them, for float32 v (same order of operations)."""
    a = torch.clamp(v.abs(), max=20.0)
    t = (1.0 / _fma(a, _f(ACC_P * 0.70710678118654752), _f(1.0)).double()).float()  # rcp.approx
    p = _fma(t, _f(0.5 * ACC_COEFFS[-1]), _f(0.5 * ACC_COEFFS[-2]))
    for k in range(len(ACC_COEFFS) - 3, -1, -1):
        p = _fma(t, p, _f(0.5 * ACC_COEFFS[k]))
    hi = a * a
    lo = _fma(a, a, -hi)                      # v^2 = hi + lo exactly
    x = hi * _f(C_HI)
    r = _fma(hi, _f(C_HI), -x)                # the product's rounding error
    r = _fma(hi, _f(_c_lo()), r)              # the constant's
    r = _fma(lo, _f(C_HI), r)                 # the square's low part
    e0 = torch.exp2(x.double()).float()       # ex2.approx.ftz
    e0 = torch.where(x < -126.0, torch.zeros_like(e0), e0)
    e = _fma(e0, r * _f(LN2), e0)             # 2^r = 1 + r ln 2 (|r| < 2^-16)
    half_erfc = (t * p) * e
    return torch.where(v < 0, half_erfc, 1.0 - half_erfc), e


def acc_errors(vmax: float = 10.0, points: int = 2_000_001) -> dict[str, float]:
    """Max relative errors of the fp32 model over v in [-vmax, vmax] (float64 references at the same float32 v):
    Phi, gelu = v Phi (one more rounding), phi (the exp with the split argument) and gelu' = Phi + v phi (relative
    to its terms Phi + |v| phi: the fp32 sum near the root v = -0.7518)."""
    v = torch.linspace(-vmax, vmax, points, dtype=torch.float32)
    phi, e = model_acc32(v)
    gelu = v * phi
    grad = _fma(v * _f(0.39894228040143268), e, phi)
    v64 = v.double()
    phi64 = 0.5 * torch.special.erfc(-v64 / math.sqrt(2))
    pdf64 = torch.exp(-0.5 * v64 * v64) / math.sqrt(2 * math.pi)
    nz = v64 != 0

    def rel(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
        return ((out.double() - ref).abs()[nz] / scale.abs()[nz]).max().item()

    return {"Phi": rel(phi, phi64, phi64), "gelu": rel(gelu, v64 * phi64, v64 * phi64),
            "exp": rel(e, pdf64 * math.sqrt(2 * math.pi), pdf64 * math.sqrt(2 * math.pi)),
            "gelu_grad": rel(grad, phi64 + v64 * pdf64, phi64 + v64.abs() * pdf64)}


def main(argv: list[str] | None = None) -> None:
    """Print the two fits and the fp32 model's error bound (no options: the fits are fixed)."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for deg, ps in ((6, (0.45,)), (9, (0.36, 0.4, 0.44))):
        best = min((fit(p, deg) + (p,) for p in ps), key=lambda x: x[1])
        print(f"degree {deg - 1}: p = {best[2]:.4g}, max rel err {best[1]:.3g}, P = {best[0].tolist()}")
    print("phi_cdf_acc in float32 (model), max relative error over |v| <= 10:", acc_errors())


if __name__ == "__main__":
    main()
