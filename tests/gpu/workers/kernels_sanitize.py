"""Small launches of every kernel path, for compute-sanitizer: memcheck in
tests/gpu/test_kernels_tools_gpu.py, racecheck as a probe (tools/gpu_probes/README.md).

    python tests/gpu/workers/kernels_sanitize.py [--plans w8.s2,w8.s3.d1] [--warm]

Per launch plan (plan.LaunchPlan labels; default DEFAULT_PLANS: every loader and store path): vector paths with
scalar heads and tails (views offset by one element), the scalar kernels (operands aligned differently), the
bias-gradient reduction, and one case on a grid of 2 blocks where each block wraps around its pipeline stages
several times (so a shared-memory buffer reused before every consumer is done with it shows up as a hazard).
Sizes are a few KiB to ~256 KiB: under a sanitizer each launch is 10-100x slower. Each result is compared with
torch; exit 0 when all match. --warm only compiles (run it without a sanitizer first: the sanitizer run then loads
cubins from CuPy's disk cache instead of spending its time budget in NVRTC).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from peerline.kernels import compile as kc
from peerline.kernels import elementwise as ew
from peerline.kernels import plan as kp

# Three plans that between them run every loader and every store path, the newest first (a run cut by its time
# limit has still checked them; each plan prints its own line): the bulk loader with direct streaming stores and
# evict-first loads (.l1.h2: residual add's default path .h1 plus the hinted loads; the same direct-store code as the
# fp32 bias+GELU defaults' w12...d1), TMA both ways (bulk loader on mbarriers, bulk stores from the storer warp), and
# the cp.async loader with the storer warp (w8.s2: the engine's default, bias+GELU bwd bf16's w8.s4). Three, as
# before, so the run stays inside the test's and the probe's time caps; `--plans` takes others
# (e.g. w8.s3.d1, the cp.async loader with direct stores). Plans with rounds (.r) need no run of their own: rounds
# only sets the grid size (same cubin; plan.vector_grid), and the grid-of-2 case below makes blocks wrap their
# stages. Nor does .p1 (phi_cdf_lite): arithmetic only, the same loads and stores.
DEFAULT_PLANS = "w4.s4.t256.d1.l1.h2,w8.s3.l1.o1,w8.s2"
# Absolute grid cap of the wrap-around case (elementwise.TUNING["grid_cap"], a test hook).
WRAP_GRID = 2


def view(n_rows: int, h: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    buf = torch.randn(n_rows * h + offset, device="cuda").to(dtype)
    return buf[offset:].view(n_rows, h)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.double(), b.double()
    return bool(torch.isfinite(a).all()) and (a - b).norm().item() <= tol * max(b.norm().item(), 1e-30)


def run_cases(rows: int, h: int, offsets: tuple[tuple[int, int], ...]) -> list[str]:
    """Every op and dtype on (rows, h) views at the given (x, g) offsets; names of the mismatches."""
    bad = []
    for dt, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        for xoff, goff in offsets:
            tag = f"{dt} ({rows}, {h}) offsets ({xoff}, {goff})"
            x, g = view(rows, h, dt, xoff), view(rows, h, dt, goff)
            b = torch.randn(h, device="cuda")
            if not close(ew.bias_gelu_forward(x, b), F.gelu(x.float() + b), tol):
                bad.append(f"fwd {tag}")
            gx, gb = ew.bias_gelu_backward(g, x, b)
            xr = x.float().requires_grad_()
            br = b.clone().requires_grad_()
            F.gelu(xr + br).backward(g.float())
            if not (close(gx, xr.grad, tol) and close(gb, br.grad, 1e-4)):
                bad.append(f"bwd {tag}")
            y = view(rows, h, torch.float32, goff)
            if not torch.equal(ew.residual_add_forward(y, x), y + x.float()):
                bad.append(f"residual fp32+{dt} {tag}")
            x2 = view(rows, h, dt, goff)
            if not torch.equal(ew.residual_add_forward(x2, g), x2 + g):
                bad.append(f"residual {dt} {tag}")
    return bad


def specs_of(p: kp.LaunchPlan) -> list[kc.KernelSpec]:
    """The kernel builds run_cases needs under plan p (bias fp32; residual x fp32 + y in x's dtype, and alike)."""
    shape = p.spec_fields()
    out = []
    for d in ("bfloat16", "float32"):
        out += [kc.KernelSpec(kc.OP_BIAS_GELU_FWD, d, bias="float32", **shape),
                kc.KernelSpec(kc.OP_BIAS_GELU_BWD, d, bias="float32", **shape),
                kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y=d, out="float32", **shape),
                kc.KernelSpec(kc.OP_RESIDUAL_ADD, d, y=d, out=d, **shape)]
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma list of plan labels")
    ap.add_argument("--warm", action="store_true", help="compile only (fills CuPy's disk cache)")
    args = ap.parse_args(argv)
    try:
        plans = [kp.parse_plan(s) for s in args.plans.split(",")]
    except ValueError as e:
        sys.stderr.write(f"kernels_sanitize: {e}\n")
        return 2
    if not torch.cuda.is_available():
        sys.stderr.write("kernels_sanitize: needs a CUDA device\n")
        return 2
    torch.manual_seed(0)
    if args.warm:  # NVRTC in parallel processes (CuPy's disk cache); the cases below then only load cubins
        specs = [s for p in plans for s in specs_of(p)]
        done = kc.warm_compile(specs, torch.cuda.current_device(), 8)
        print(f"kernels_sanitize: {done} of {len(specs)} builds compiled in parallel")
    ew.POISON_OUTPUTS = True
    bad: list[str] = []
    t0 = time.monotonic()
    for p in plans:
        ew.TUNING.clear()
        ew.TUNING.update(p.tuning())
        before = len(bad)
        try:
            # (7, 1000): same misalignment (vector + head/tail, non-vector bias) and different (scalar kernels)
            bad += [f"{p.label()}: {b}" for b in run_cases(7, 1000, ((1, 1), (0, 1)))]
            if not args.warm:
                # 2 blocks, 64 x 1024 elements (16 tiles of bf16, 32 of fp32): each block wraps its stages
                ew.TUNING["grid_cap"] = WRAP_GRID
                bad += [f"{p.label()} grid {WRAP_GRID}: {b}" for b in run_cases(64, 1024, ((0, 0),))]
        finally:
            ew.TUNING.clear()
        torch.cuda.synchronize()
        if not args.warm:  # one line per plan, flushed: a run cut by its time limit still says what it checked
            print(f"kernels_sanitize: plan {p.label()} {'ok' if len(bad) == before else 'MISMATCH'} "
                  f"at {time.monotonic() - t0:.0f} s", flush=True)
    for b in bad:
        print("MISMATCH", b)
    print("kernels_sanitize:", "all results match" if not bad else f"{len(bad)} MISMATCHES",
          f"({len(plans)} plans{', warm-up only' if args.warm else ''})")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
