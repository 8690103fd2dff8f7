"""Small launches of every kernel path, for compute-sanitizer (memcheck, racecheck) in run_kernels.sh.

Vector paths with scalar heads and tails (views offset by one element), the scalar kernels (operands aligned
differently), the bias-gradient reduction; each result is compared with torch. Exit 0 when all match.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from peerline.kernels import elementwise as ew


def view(n_rows: int, h: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    buf = torch.randn(n_rows * h + offset, device="cuda").to(dtype)
    return buf[offset:].view(n_rows, h)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.double(), b.double()
    return bool(torch.isfinite(a).all()) and (a - b).norm().item() <= tol * max(b.norm().item(), 1e-30)


def main() -> int:
    torch.manual_seed(0)
    ok = True
    for dt, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        for xoff, goff in ((1, 1), (0, 1)):  # same misalignment (vector + head/tail), different (scalar)
            x, g = view(7, 1000, dt, xoff), view(7, 1000, dt, goff)
            b = torch.randn(1000, device="cuda")
            ok &= close(ew.bias_gelu_forward(x, b), F.gelu(x.float() + b), tol)
            gx, gb = ew.bias_gelu_backward(g, x, b)
            xr = x.float().requires_grad_()
            br = b.clone().requires_grad_()
            F.gelu(xr + br).backward(g.float())
            ok &= close(gx, xr.grad, tol) and close(gb, br.grad, 1e-4)
            y = view(7, 1000, torch.float32, goff)
            ok &= close(ew.residual_add_forward(y, x), y + x.float(), 1e-6)
    torch.cuda.synchronize()
    print("kernels_sanitize:", "all results match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
