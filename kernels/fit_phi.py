"""Refits the cheap Phi of elementwise.cu (phi_cdf_fast) for relative error: erfc(z) = t P(t) exp(-z^2),
t = 1 / (1 + p z), P of degree DEG - 1, by weighted least squares on erfcx(z) / t with Lawson re-weighting, in
float64. Prints the best p on a grid, the max relative error on erfc and P's coefficients (lowest power first).
Offline tool (`python -m peerline.kernels.fit_phi`, a few seconds on a CPU); its output is pasted into the kernel.
"""

from __future__ import annotations

import torch


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


def main() -> None:
    for deg in (5, 6):
        best = min((fit(0.4 + 0.025 * i, deg) + (0.4 + 0.025 * i,) for i in range(12)), key=lambda x: x[1])
        print(f"degree {deg - 1}: p = {best[2]:.4g}, max rel err {best[1]:.3g}, P = {best[0].tolist()}")


if __name__ == "__main__":
    main()
