"""Benchmark suite `kernels`: achieved GB/s of peerline's elementwise kernels next to torch eager and a
device-to-device copy of the same bytes, all in one run.

    python -m peerline.bench.suites.kernels [--out DIR] [--sizes-mib 1,16,256,1024] [--quick]
    python -m peerline.bench.suites.kernels --sweep [--out DIR] [--sweep-budget 60] [--sweep-plans L,...]
        [--sweep-cases SUBSTR,...]   (launch-shape sweep)

Bytes counted: every input read once and every output written once (bias vectors are negligible and not counted),
the same figure for peerline and torch, so the GB/s ratio is the time ratio. The copy moves (read + written) / 2
bytes, so its GB/s counts the same total. `size` is the MiB of x.

Timing: each measurement is a CUDA graph of K calls (K from 64 at 1 MiB down to 1 at 1 GiB), replayed after a
warm-up and timed with CUDA events, per call = replay / K: this times device work, not
Python launch overhead. Calls rotate over enough input sets (at least 256 MiB in all) that they do not run out
of L2. With --quick (or ctx.quick) it runs tiny sizes on whatever device there is (the CPU: torch against torch),
only to smoke-test the suite. peerline, torch and the copy of one case are timed in rotation
(benchkit.time_interleaved: torch, copy, peerline, torch, ...), so drift over the run falls on all three alike,
and an untimed L2 scrub (a read of 2 x L2) comes before each replay, so none pays for another's write-backs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.kernel_tools import common
from peerline.bench.kernel_tools.common import HIDDEN, ROTATE_BYTES

log = logging.getLogger(__name__)

SUITE = "kernels"
DEFAULT_SIZES_MIB = (1, 16, 256, 1024)


def _graph_time(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Milliseconds per call: K calls captured into one graph, replay timed (common.graph_times of one list)."""
    return common.graph_times([calls], device, reps)[0]


def _cases(dtype: torch.dtype, n: int, device: torch.device, sets: int, peerline: bool) -> dict[str, tuple]:
    """name -> (bytes moved, peerline calls or None, torch calls, anchor name)."""
    from peerline.kernels import elementwise as ew  # lazy: CUDA only

    h = HIDDEN if n % HIDDEN == 0 else n
    rows = n // h
    es = dtype.itemsize
    xs = [torch.randn(rows, h, device=device).to(dtype) for _ in range(sets)]
    gs = [torch.randn(rows, h, device=device).to(dtype) for _ in range(sets)]
    bias32 = torch.randn(h, device=device)
    bias_x = bias32.to(dtype)
    vs = [x + bias_x for x in xs]  # what torch's autograd saves for gelu's backward
    res32 = [torch.randn(rows, h, device=device) for _ in range(sets)] if dtype == torch.bfloat16 else None

    def cyc(fn: Callable[[int], object]) -> list[Callable[[], object]]:
        return [(lambda i=i: fn(i)) for i in range(sets)]

    cases: dict[str, tuple] = {
        f"bias_gelu_fwd {dtype_name(dtype)}": (
            2 * n * es,
            cyc(lambda i: ew.bias_gelu_forward(xs[i], bias32)) if peerline else None,
            cyc(lambda i: F.gelu(xs[i] + bias_x)), "torch F.gelu(x + b)"),
        f"bias_gelu_bwd {dtype_name(dtype)}": (
            3 * n * es,
            cyc(lambda i: ew.bias_gelu_backward(gs[i], xs[i], bias32)) if peerline else None,
            cyc(lambda i: common.torch_gelu_bwd(gs[i], vs[i])), "torch gelu_backward + bias sum"),
        f"residual_add {dtype_name(dtype)}+{dtype_name(dtype)}": (
            3 * n * es,
            cyc(lambda i: ew.residual_add_forward(xs[i], gs[i])) if peerline else None,
            cyc(lambda i: xs[i] + gs[i]), "torch x + y"),
    }
    if res32 is not None:
        cases["residual_add fp32+bf16"] = (
            n * (4 + 2 + 4),
            cyc(lambda i: ew.residual_add_forward(res32[i], xs[i])) if peerline else None,
            cyc(lambda i: res32[i] + xs[i]), "torch x + y")
    return cases


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


# Kernel variants timed against the default (8 compute warps, 2 stages, the cheap Phi for bf16) at 256 MiB bf16,
# in the same run: the original kernel (4 warps, 1 + erff; its label says "first run's"), and one change at a time
# from it, so each design choice shows its own share.
VARIANTS: tuple[tuple[str, dict[str, int]], ...] = (
    ("first run's kernel: 4 compute warps, 1 + erff", {"warps": 4, "stages": 2, "gelu": 2}),
    ("8 compute warps, 1 + erff", {"warps": 8, "stages": 2, "gelu": 2}),
    ("8 compute warps, exact normcdff", {"warps": 8, "stages": 2, "gelu": 0}),
    ("4 compute warps, cheap Phi", {"warps": 4, "stages": 2, "gelu": 1}),
)
# residual add runs the one-pass pl_flat by default; its variant is the warp-specialized engine it replaced
RESIDUAL_VARIANTS: tuple[tuple[str, dict[str, int]], ...] = (
    ("the warp-specialized engine, 4 compute warps, 2 stages", {"warps": 4, "stages": 2, "engine": 1}),
)
# fp32 results: normcdff + exact phi_pdf (the form phi_cdf_acc replaces), against the default in the same run
FP32_VARIANTS: tuple[tuple[str, dict[str, int]], ...] = (
    ("exact normcdff (PL_GELU 0, the fp32 path before phi_cdf_acc)", {"gelu": 0}),
)
DEFAULT_LABEL = "default: 8 compute warps, 2 stages, cheap Phi (refitted A&S 7.1.26 form)"
FP32_DEFAULT_LABEL = "default: phi_cdf_acc (refitted erfc form, < 1e-6 relative)"
VARIANT_MIB = 256
VARIANT_SETS = ("all", "fp32")


def _variants(device: torch.device, reps: int, ctx: BenchContext, which: str = "all") -> None:
    """bias+GELU fwd/bwd at 256 MiB with other block shapes and GELU math, in the same run as the default: bf16
    (block shapes, the original 1 + erff, normcdff) unless `which` is "fp32", and fp32 (normcdff, the path
    before phi_cdf_acc)."""
    from peerline.kernels import elementwise as ew

    groups = []
    if which == "all":
        groups.append((torch.bfloat16, (("bias_gelu_fwd bf16", VARIANTS), ("bias_gelu_bwd bf16", VARIANTS),
                                        ("residual_add bf16+bf16", RESIDUAL_VARIANTS))))
    groups.append((torch.float32, (("bias_gelu_fwd fp32", FP32_VARIANTS), ("bias_gelu_bwd fp32", FP32_VARIANTS))))
    for dtype, named in groups:
        _variant_group(device, reps, ctx, ew, dtype, named)


def _variant_group(device: torch.device, reps: int, ctx: BenchContext, ew: Any, dtype: torch.dtype,
                   named: tuple) -> None:
    n = VARIANT_MIB * (1 << 20) // dtype.itemsize
    cases = _cases(dtype, n, device, 1, True)
    for name, variants in named:
        nbytes, pl_calls, _, _ = cases[name]
        base = _graph_time(pl_calls, device, reps)
        on_plan = {}
        if variants is FP32_VARIANTS:
            # only the GELU changes: the op's own launch plan (elementwise.TUNED_PLANS) stays, as in `base`
            from peerline.kernels import compile as kc

            op = kc.OP_BIAS_GELU_FWD if name.startswith("bias_gelu_fwd") else kc.OP_BIAS_GELU_BWD
            on_plan = ew._tuning(op, "float32")
        for label, tuning in variants:
            ew.TUNING.update({**on_plan, **tuning})
            try:
                t = _graph_time(pl_calls, device, reps)
            finally:
                ew.TUNING.clear()
            default_label = {id(VARIANTS): DEFAULT_LABEL, id(FP32_VARIANTS): FP32_DEFAULT_LABEL}.get(
                id(variants), "default: one-pass pl_flat")
            ctx.record(Record(SUITE, f"{name} {VARIANT_MIB} MiB: {label}", "GB/s",
                              nbytes / (t * 1e-3) / 1e9, nbytes / (base * 1e-3) / 1e9, default_label,
                              sizes={"x_MiB": VARIANT_MIB, "bytes": nbytes},
                              extra={**tuning, "ms": t, "default_ms": base}))
    del cases


# The kernels' goals: (case prefix, anchor_name prefix, smallest size in MiB, least ratio peerline / anchor): bias+GELU
# fwd bf16 at least 3x torch's unfused gelu(x + b), and for every op at >= 256 MiB at least 90% of the copy
# bandwidth, at >= 16 MiB never slower than torch eager.
GOAL_OPS = ("bias_gelu_fwd bf16", "bias_gelu_fwd fp32", "bias_gelu_bwd bf16", "bias_gelu_bwd fp32",
            "residual_add bf16+bf16", "residual_add fp32+fp32", "residual_add fp32+bf16")
GOALS: tuple[tuple[str, str, float, float], ...] = (
    ("bias_gelu_fwd bf16", "torch", 256, 3.0),
    *((op, "d2d copy", 256, 0.9) for op in GOAL_OPS),
    *((op, "torch", 16, 1.0) for op in GOAL_OPS),
)


def goal_lines(records: list[Record]) -> list[str]:
    """One 'GOAL MET|MISSED' line per goal and size (the default kernel only, not the variants)."""
    lines = []
    for case, anchor, min_mib, least in GOALS:
        for r in records:
            mib = r.sizes.get("x_MiB")
            if (r.suite != SUITE or ":" in r.case or not r.case.startswith(case + " ") or mib is None
                    or mib < min_mib or not r.anchor_name.startswith(anchor) or r.anchor <= 0):
                continue
            ratio = r.peerline / r.anchor
            lines.append(f"GOAL {'MET' if ratio >= least else 'MISSED'} {r.case}: {ratio:.2f}x {r.anchor_name} "
                         f"(>= {least:g})")
    return lines


def _record_case(ctx: BenchContext, name: str, case: tuple, size_mib: float, dtype: torch.dtype, n: int,
                 sets: int, reps: int, peerline: bool) -> None:
    """Time one case (torch, copy and peerline in rotation) and record peerline against torch and the copy."""
    nbytes, pl_calls, torch_calls, anchor_name = case
    device = ctx.device
    copy_calls = common.copy_calls(nbytes, device, min(sets, max(1, ROTATE_BYTES // nbytes)))
    # in rotation (torch, peerline, copy, torch, ...): the ratios near 1 are the goals' business
    lists = [torch_calls, copy_calls, *([pl_calls] if pl_calls else [])]
    t_torch, t_copy, *t_rest = common.graph_times(lists, device, reps)
    t_pl = t_rest[0] if t_rest else t_torch
    gbps = {k: nbytes / (t * 1e-3) / 1e9 for k, t in (("peerline", t_pl), ("torch", t_torch), ("copy", t_copy))}
    sizes_d = {"x_MiB": size_mib, "dtype": dtype_name(dtype), "bytes": nbytes, "elements": n}
    ctx.record(Record(SUITE, f"{name} {size_mib:g} MiB", "GB/s", gbps["peerline"], gbps["torch"],
                      anchor_name if peerline else "torch (CPU: torch vs torch)", sizes=sizes_d,
                      extra={"ms": {"peerline": t_pl, "torch": t_torch, "copy": t_copy}}))
    ctx.record(Record(SUITE, f"{name} {size_mib:g} MiB", "GB/s", gbps["peerline"], gbps["copy"],
                      "d2d copy of the same bytes", sizes=sizes_d))
    log.info("%s %g MiB: peerline %.0f GB/s, torch %.0f GB/s, copy %.0f GB/s", name, size_mib,
             gbps["peerline"], gbps["torch"], gbps["copy"])


def _measure_size(ctx: BenchContext, size_mib: float, dtype: torch.dtype, reps: int, quick: bool) -> None:
    """Every op of one dtype at one size."""
    device, peerline = ctx.device, ctx.device.type == "cuda"
    n = max(HIDDEN if not quick else 64, int(size_mib * (1 << 20)) // dtype.itemsize)
    sets = max(1, min(64, ROTATE_BYTES // (n * dtype.itemsize))) if not quick else 2
    cases = _cases(dtype, n, device, sets, peerline)
    for name, case in cases.items():
        _record_case(ctx, name, case, size_mib, dtype, n, sets, reps, peerline)
    del cases
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Record peerline vs torch eager and vs a d2d copy for each op, dtype and size."""
    quick = ctx.quick or getattr(args, "quick", False)
    sizes = getattr(args, "kernel_sizes_mib", None) or DEFAULT_SIZES_MIB
    reps = getattr(args, "reps", None) or 20  # None: the common --reps flag was not given
    if quick:
        sizes, reps = (1 / 64,), 3
    for size_mib in sizes:
        for dtype in (torch.bfloat16, torch.float32):
            _measure_size(ctx, size_mib, dtype, reps, quick)
        if getattr(args, "write_partial", False):
            ctx.write(SUITE)  # a run cut short by its time limit still leaves the sizes it finished
    if ctx.device.type == "cuda" and not quick and getattr(args, "kernel_variants", True):
        _variants(ctx.device, reps, ctx, getattr(args, "variant_set", "all"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="peerline kernels benchmark (one suite)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--sizes-mib", dest="kernel_sizes_mib", type=lambda s: tuple(float(v) for v in s.split(",")),
                    default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-variants", dest="kernel_variants", action="store_false",
                    help="skip the kernel variants of bias+GELU at 256 MiB")
    ap.add_argument("--variant-set", choices=VARIANT_SETS, default="all",
                    help="all: bf16 shapes and GELU forms plus fp32 normcdff; fp32: only fp32 normcdff vs the default")
    ap.add_argument("--sweep", action="store_true",
                    help="launch-shape sweep instead (bench/kernel_tools/sweep.py): best plan per op, OUT/sweep.jsonl")
    ap.add_argument("--sweep-budget", type=float, default=60.0, help="seconds for the sweep, compiles included")
    ap.add_argument("--sweep-plans", default=None,
                    help="comma list of plan labels (e.g. w8.s3.d1,w16.s3.d1@fwd+bwd,w4.s4.t256.d1.l1@res: '@' "
                         "restricts a plan to op kinds fwd|bwd|res); default: sweep.SWEEP_PLANS")
    ap.add_argument("--sweep-cases", default=None,
                    help="comma list of substrings of case names to keep (e.g. 'residual_add,fwd fp32'); "
                         "default: every case of sweep.SWEEP_CASES")
    ap.add_argument("--sweep-mib", default=None,
                    help="comma list of MiB of x: every kept case at each of these sizes instead of its own (e.g. "
                         "8,16,32,64: where a plan's lead turns over)")
    args = ap.parse_args(argv)
    args.write_partial = True
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if args.sweep:
        from peerline.bench.kernel_tools.sweep import SWEEP_CASES, parse_sweep_plan, run_sweep, select_cases

        labels = [t for t in args.sweep_plans.split(",") if t.strip()] if args.sweep_plans else None
        cases = [t for t in args.sweep_cases.split(",") if t.strip()] if args.sweep_cases else None
        try:
            for label in labels or []:
                parse_sweep_plan(label)
            select_cases(SWEEP_CASES, cases)
            sizes = [float(v) for v in args.sweep_mib.split(",") if v.strip()] if args.sweep_mib else None
            if sizes is not None and (not sizes or min(sizes) <= 0):
                raise ValueError(f"--sweep-mib needs sizes > 0, got {args.sweep_mib!r}")
        except ValueError as e:
            sys.stderr.write(f"kernels --sweep: {e}\n")
            return 2
        if device.type != "cuda":
            sys.stderr.write("kernels --sweep: needs a CUDA device\n")
            return 2
        run_sweep(args.out, device, args.sweep_budget, labels, args.reps if args.reps != 20 else 30, cases, sizes)
        return 0
    ctx = BenchContext(out_dir=args.out, device=device, quick=args.quick)
    run(args, ctx)
    ctx.write_and_show(SUITE)
    for line in goal_lines(ctx.records):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
