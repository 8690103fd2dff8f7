"""Launch-shape sweep of the warp-specialized kernels: which plan.LaunchPlan is fastest per op.

    python -m peerline.bench.suites.kernels --sweep --out DIR [--sweep-budget 60] [--sweep-plans w8.s3.d1,...]
        [--sweep-cases SUBSTR,...] [--sweep-mib 8,16,...]
    python -m peerline.bench.kernel_tools.sweep --summarize DIR/sweep.jsonl

For each case (op, dtype, size) the sweep times torch eager and a device-to-device copy of the same bytes once,
then every plan of the grid (SWEEP_PLANS, default plan first) that passed a correctness check, in the same run.
Correctness first: before a plan is timed, every op runs it on an odd-sized misaligned input (scalar head and tail)
and on one large enough that each block wraps around its pipeline stages, outputs poisoned with NaN, against a
float64 torch reference (bounds of tests/gpu/test_kernels_elementwise.py); a plan that fails is reported as such
and never timed, so a fast-but-wrong plan cannot be the best. Writes DIR/sweep.jsonl (one row per case and plan)
and prints one "SWEEP BEST" line per case, one "SWEEP TUNED op:dtype=plan" line per TUNED_PLANS key and a
"SWEEP TUNED_PLANS = ..." string to paste into kernels/elementwise.py (or PEERLINE_KERNEL_PLANS). Bounded by
--sweep-budget seconds (compiles included): the default plan is always timed, further plans only while the budget
lasts. `--summarize` prints the same lines from a sweep.jsonl (also one cut short by a time limit).

Why these plans (kernels/README.md): a streaming op through shared memory loses to torch's plain vectorized kernel
when too few bytes are in flight per SM (stages, tile size, resident blocks), when the result's extra
shared-memory round trip and the single storer warp's issue rate throttle the stores (direct stores), or when the
last tiles leave SMs idle (smaller tiles, rounds).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from peerline.bench.kernel_tools import common
from peerline.kernels import compile as kc
from peerline.kernels import elementwise as ew
from peerline.kernels import plan as kp

log = logging.getLogger(__name__)

# Most promising first: the budget may cut the tail of the list. "@fwd+bwd" after a label restricts a plan to those
# op kinds (fwd | bwd | res): it is neither checked nor timed on the others (saves budget where a plan cannot help).
SWEEP_PLANS = (
    "w8.s2",                   # the design default (always timed first)
    # the tuned plans (elementwise.TUNED_PLANS) and their predecessors, so other plans are judged against them
    "w16.s3.t1024.d1@fwd+bwd",  # bias+GELU fwd bf16
    "w12.s4.d1@fwd+bwd",       # bias+GELU fwd fp32
    "w12.s2.d1@fwd+bwd",       # bias+GELU bwd fp32
    "w4.s4.t256.d1",           # residual add
    "w8.s4@bwd",               # bias+GELU bwd bf16
    "w8.s3.d1",                # bias+GELU fwd, an earlier choice
    "w8.s4.d1.v2@bwd+res",     # bias+GELU bwd fp32 earlier; for residual add: 32 contiguous bytes per lane
    # cache hints for data used once (.h1: st.global.cs stores; .h2: also evict-first bulk loads), on the bulk
    # loader plans of residual add and the bf16 forward
    "w4.s4.t256.d1.l1.h1@res",
    "w4.s4.t256.d1.l1.h2@res",
    "w16.s3.t1024.d1.l1.h2@fwd",
    "w8.s4.d1.l1.h2@res",
    "w4.s8.t256.d1.l1.h2@res",
    "w16.s3.t1024.d1.l1.h1@fwd",
    # rounds (.rN): at most N tiles per block, so the grid goes beyond the resident blocks and the hardware's block
    # scheduler deals the rest to whichever SM frees up first. A persistent grid gives each block a fixed
    # (round-robin) share, so the slowest SM sets the end; torch's add (a grid of short blocks) does not. Same
    # cubins as the plans they extend: no compiles.
    "w4.s4.t256.d1.l1.h1.r4@res",
    "w16.s3.t1024.d1.l1.r8@fwd",
    "w4.s4.t256.d1.l1.h1.r16@res",
    "w12.s4.d1.r8@fwd",
    "w4.s4.t256.d1.l1.h1.r2@res",
    "w16.s3.t1024.d1.l1.r4@fwd",
    "w4.s4.t256.d1.l1.h1.r8@res",
    "w12.s4.d1.r4@fwd",
    "w4.s4.t256.d1.l1.h1.r32@res",
    "w16.s3.t1024.d1.l1.r16@fwd",
    "w8.s4.d1.l1.h2.r8@res",   # a strong 16 MiB plan without rounds, with rounds
    "w8.s4.d1.l1.h1@res",      # streaming stores on w8.s4
    "w8.s6.t1024.d1.l1.h1@res",  # one block per SM, 6 x 32 KiB stages (192 KiB in flight from one TMA lane)
    "w12.s4.d1.l1.r8@fwd",     # the fp32 forward's shape on the bulk loader, with rounds
    # phi (.p1): the bf16 forward's Phi with a degree-3 P (phi_cdf_lite, 7.8e-4 relative): 135 instead of 151 SASS
    # instructions per 8 elements in the loop, for an op that issues close to its memory rate (fp32 unchanged)
    "w16.s3.t1024.d1.l1.p1@fwd",
    "w16.s3.t1024.d1.l1.r8.p1@fwd",
    # More shapes, residual add and bias+GELU interleaved so that a budget cut leaves both some of each. Residual add:
    # the Hopper bulk loader (one cp.async.bulk per operand tile on an mbarrier, .l1) with direct stores, from the
    # tuned shape to more bytes in flight per SM, and TMA both ways (.l1.o1: bulk stores from the storer warp).
    # bias+GELU (issue-bound, fp32 above all): 12 / 16 compute warps (448 / 576 threads a block).
    "w4.s4.t256.d1.l1@res",
    "w16.s3.t1024.d1.l1@fwd+bwd",  # the bulk loader for bias+GELU too, on its best shapes
    "w16.s3.d1@fwd+bwd",
    "w8.s4.d1.l1@res",
    "w12.s3.d1@fwd+bwd",
    "w8.s4.l1.o1@res",         # compute warps do only LDS, add, STS; every global access is the TMA unit's
    "w12.s4.d1.l1@fwd+bwd",
    "w16.s2.d1@fwd+bwd",
    "w4.s8.t256.d1.l1@res",    # 8 stages x 8 KiB (bf16): ~64 KiB in flight per block from one issuing lane
    "w8.s3.t1024.d1.b2.l1@res",  # 2 blocks per SM with 48 KiB stages
    "w16.s4.d1@fwd+bwd",
    "w4.s4.t256.l1.o1@res",
    "w16.s4@bwd",              # 16 warps through the storer warp (bwd bf16 prefers no direct stores)
    "w8.s4.t1024.d1.l1@res",
    "w12.s2.d1.l1@bwd",
    "w8.s3.t1024.l1.o1@res",
    "w8.s2.l1@res",            # bulk loader through the storer warp (the book's output path)
    # the base grid (each best or near it for some op)
    "w8.s2.d1",                # direct stores: no C round trip through shared memory, no storer hand-off
    "w8.s4.d1",                # deeper: more loads in flight per block
    "w4.s4.d1",                # fewer compute warps, more blocks per SM
    "w4.s4.t128.d1@res",       # one chunk per compute thread: the most tiles per block at 16 MiB
    "w8.s4.t1024.d1@res",      # bigger tiles: more bytes per hand-off
    "w8.s3",
    "w8.s4.t256",
)
KINDS = ("fwd", "bwd", "res")
# (case name, op, dtype, MiB of x)
SWEEP_CASES = (
    ("bias_gelu_fwd bf16", "fwd", torch.bfloat16, 256),
    ("bias_gelu_fwd fp32", "fwd", torch.float32, 256),
    ("bias_gelu_bwd fp32", "bwd", torch.float32, 256),
    ("bias_gelu_bwd bf16", "bwd", torch.bfloat16, 256),
    ("residual_add bf16+bf16", "res", torch.bfloat16, 256),
    ("residual_add bf16+bf16", "res", torch.bfloat16, 16),
    ("residual_add fp32+fp32", "res", torch.float32, 256),
    ("residual_add fp32+fp32", "res", torch.float32, 16),
    ("residual_add bf16+bf16", "res", torch.bfloat16, 1024),
    ("residual_add fp32+fp32", "res", torch.float32, 1024),
)


def parse_sweep_plan(text: str) -> tuple[str, frozenset[str]]:
    """'w16.s3.d1@fwd+bwd' -> (plan label, its op kinds); no '@': every kind. ValueError on a bad label or kind."""
    label, _, kinds = text.strip().partition("@")
    kp.parse_plan(label)
    ks = frozenset(filter(None, kinds.split("+"))) if kinds else frozenset(KINDS)
    bad = ks - set(KINDS)
    if bad:
        raise ValueError(f"bad op kind(s) {sorted(bad)} in sweep plan {text!r}; kinds: {', '.join(KINDS)}")
    return label, ks


def select_cases(cases: tuple, filters: list[str] | None) -> tuple:
    """The cases whose full name ('<case> <MiB> MiB', e.g. 'residual_add bf16+bf16 16 MiB') contains any of the
    filter strings (all cases when filters is empty or None); '/' in a filter stands for a space (shell-friendly:
    'fwd/fp32', 'bf16+bf16/16/MiB'). ValueError when nothing is left."""
    if not filters:
        return cases
    out = tuple(c for c in cases if any(f.replace("/", " ") in f"{c[0]} {c[3]:g} MiB" for f in filters))
    if not out:
        raise ValueError(f"no sweep case matches {filters}; cases: "
                         + "; ".join(f"{c[0]} {c[3]:g} MiB" for c in cases))
    return out


def with_sizes(cases: tuple, sizes_mib: list[float] | None) -> tuple:
    """Each distinct (case, op kind, dtype) of `cases` at every size of `sizes_mib` (None: `cases` unchanged)."""
    if not sizes_mib:
        return cases
    kinds = dict.fromkeys((name, kind, dt) for name, kind, dt, _ in cases)
    return tuple((name, kind, dt, mib) for name, kind, dt in kinds for mib in sizes_mib)


# (shape, offset of the inputs' views): head and tail with a non-vector bias; then ~8.4 M elements, so every block
# wraps its stages several times, with a vector bias
CHECK_SHAPES = (((37, 1001), 1), ((2063, 4096), 0))
BOUND = {torch.float32: 2e-6, torch.bfloat16: 6e-3}
BIAS_BOUND = {torch.float32: 2e-5, torch.bfloat16: 6e-3}


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, offset: int = 0,
           scale: float = 1.0) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.randn(n + offset, device=device) * scale).to(dtype)[offset:].view(shape)


def _rel(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    out64 = out.double()
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    denom = (ref if scale is None else scale).norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


def _gelu64(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * torch.special.erfc(-v / math.sqrt(2))  # no 1 + erf cancellation for v << 0


def check_op(kind: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the current ew.TUNING plan computes `kind` right on the check shapes, else what failed."""
    for shape, off in CHECK_SHAPES:
        h = shape[-1]
        x = _randn(shape, dtype, device, off, 2.0)
        b = _randn((h,), torch.float32, device)
        v = (x.float() + b).double()
        if kind == "fwd":
            err = _rel(ew.bias_gelu_forward(x, b), _gelu64(v))
            if not err < BOUND[dtype]:
                return f"fwd {shape} off {off}: rel err {err:.3g}"
        elif kind == "bwd":
            g = _randn(shape, dtype, device, off)
            gx, gb = ew.bias_gelu_backward(g, x, b)
            pdf = torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
            cdf = 0.5 * torch.special.erfc(-v / math.sqrt(2))
            prod = g.double() * (cdf + v * pdf)
            terms = g.double().abs() * (cdf + v.abs() * pdf)
            err, err_b = _rel(gx, prod, terms), _rel(gb, prod.reshape(-1, h).sum(0))
            if not (err < BOUND[dtype] and err_b < BIAS_BOUND[torch.float32]):
                return f"bwd {shape} off {off}: grad_x rel err {err:.3g}, bias grad {err_b:.3g}"
        else:
            y = _randn(shape, dtype, device, off)
            if not torch.equal(ew.residual_add_forward(x, y), x + y):
                return f"residual_add {shape} off {off}: differs from torch's x + y"
    return None


def _calls(kind: str, dtype: torch.dtype, n: int, device: torch.device) -> tuple[int, list, list]:
    """(bytes moved, peerline calls, torch calls) of one case: one call per input set, enough sets (256 MiB in all,
    as the kernels suite) that a 16 MiB case does not run out of L2."""
    hidden = common.HIDDEN
    rows = n // hidden
    es = dtype.itemsize
    sets = max(1, min(64, common.ROTATE_BYTES // (n * es)))
    xs = [torch.randn(rows, hidden, device=device).to(dtype) for _ in range(sets)]
    b32 = torch.randn(hidden, device=device)
    bx = b32.to(dtype)
    if kind == "fwd":
        return (2 * n * es, [(lambda x=x: ew.bias_gelu_forward(x, b32)) for x in xs],
                [(lambda x=x: F.gelu(x + bx)) for x in xs])
    gs = [torch.randn(rows, hidden, device=device).to(dtype) for _ in range(sets)]
    if kind == "bwd":
        vs = [x + bx for x in xs]  # what torch's autograd saves for gelu's backward
        return (3 * n * es, [(lambda g=g, x=x: ew.bias_gelu_backward(g, x, b32)) for g, x in zip(gs, xs)],
                [(lambda g=g, v=v: common.torch_gelu_bwd(g, v)) for g, v in zip(gs, vs)])
    return (3 * n * es, [(lambda x=x, g=g: ew.residual_add_forward(x, g)) for x, g in zip(xs, gs)],
            [(lambda x=x, g=g: x + g) for x, g in zip(xs, gs)])


def _specs_for(plans: list, cases: tuple) -> list:
    """KernelSpecs of every (plan, op kind, dtype) the sweep will run; plans are (LaunchPlan, kinds) pairs."""
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    out = []
    for p, kinds in plans:
        t = p.spec_fields()
        for kind, dt in {(c[1], c[2]) for c in cases if c[1] in kinds}:
            d = names[dt]
            try:
                if kind == "fwd":
                    out.append(kc.KernelSpec(kc.OP_BIAS_GELU_FWD, d, bias="float32", **t))
                elif kind == "bwd":
                    out.append(kc.KernelSpec(kc.OP_BIAS_GELU_BWD, d, bias="float32", **t))
                else:
                    out.append(kc.KernelSpec(kc.OP_RESIDUAL_ADD, d, y=d, out=d, **t))
            except ValueError:
                pass  # the plan does not fit this op (shared memory): check_op reports it
    return list(dict.fromkeys(out))


def best_line(case: str, rows: list[dict], default_label: str) -> str:
    """'SWEEP BEST <case>: <plan> <GB/s>, <x> torch, <x> copy; default ...' from one case's rows."""
    timed = [r for r in rows if r["status"] == "ok"]
    wrong = sum(r["status"] == "wrong" for r in rows)
    if not timed:
        return f"SWEEP BEST {case}: no plan timed ({wrong} wrong)"
    best = max(timed, key=lambda r: r["GBps"])
    base = next((r for r in timed if r["plan"] == default_label), None)
    dflt = (f"default {base['GBps']:.0f} GB/s = {base['vs_torch']:.2f}x torch, {base['vs_copy']:.2f}x copy"
            if base else "default not timed")
    again = next((r for r in rows if r["status"] == "repeat" and r["plan"] == default_label), None)
    if base and again:
        dflt += f" (again at the end: {again['GBps']:.0f}, {100 * (again['GBps'] / base['GBps'] - 1):+.1f}%)"
    return (f"SWEEP BEST {case}: {best['plan']} {best['GBps']:.0f} GB/s = {best['vs_torch']:.2f}x torch "
            f"({best['torch_GBps']:.0f}), {best['vs_copy']:.2f}x copy ({best['copy_GBps']:.0f}); {dflt}; "
            f"{len(timed)} plans timed, {wrong} wrong")


def run_sweep(out_dir: Path, device: torch.device, budget_s: float = 60.0, plan_labels: list[str] | None = None,
              reps: int = 10, case_filters: list[str] | None = None,
              sizes_mib: list[float] | None = None) -> list[dict]:
    """Check, then time each plan per case; write out_dir/sweep.jsonl; return its rows. `plan_labels` entries may
    carry '@kinds' (parse_sweep_plan); `case_filters` keeps the cases whose name contains one of the strings;
    `sizes_mib` replaces the kept cases' sizes (each kept op and dtype at every one of these sizes)."""
    t0 = time.monotonic()
    sweep_cases = with_sizes(select_cases(SWEEP_CASES, case_filters), sizes_mib)
    plans = _sweep_plans(plan_labels)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sweep.jsonl"
    _warm(plans, sweep_cases, device, t0)
    ok = _check_plans(plans, sweep_cases, device)
    log.info("sweep: correctness checked at %.1f s", time.monotonic() - t0)
    cases = _anchor_cases(sweep_cases, device, reps)
    log.info("sweep: anchors timed at %.1f s", time.monotonic() - t0)
    rows = _time_plans(path, plans, cases, ok, device, reps, budget_s, t0)
    del cases
    torch.cuda.empty_cache()
    for line in report_lines(rows, plans[0][0].label()):
        sys.stdout.write(line + "\n")
    for (label, kind, dt), err in ok.items():
        if err is not None:
            sys.stdout.write(f"SWEEP WRONG {label} {kind} {dt}: {err}\n")
    log.info("sweep: done in %.1f s, %s", time.monotonic() - t0, path)
    return rows


def _sweep_plans(plan_labels: list[str] | None) -> list[tuple[kp.LaunchPlan, frozenset[str]]]:
    """(plan, op kinds) of every label (SWEEP_PLANS by default), the default plan first on every kind, no plan
    twice."""
    plans: list[tuple[kp.LaunchPlan, frozenset[str]]] = []
    for text in plan_labels or SWEEP_PLANS:
        label, kinds = parse_sweep_plan(text)
        plans.append((kp.parse_plan(label), kinds))
    default = kp.LaunchPlan()
    plans = [(p, k) for p, k in plans if p != default]
    plans.insert(0, (default, frozenset(KINDS)))  # always first, on every case
    return list(dict.fromkeys(plans))


def _warm(plans: list, sweep_cases: tuple, device: torch.device, t0: float) -> None:
    """NVRTC-compile every build the sweep needs in parallel processes (kc.warm_compile) before any timing."""
    specs = _specs_for(plans, sweep_cases)
    workers = min(8, os.cpu_count() or 1)
    n_warm = kc.warm_compile(specs, device.index or 0, workers)
    log.info("sweep: %d of %d kernel builds compiled in parallel in %.1f s", n_warm, len(specs),
             time.monotonic() - t0)


def _check_plans(plans: list, sweep_cases: tuple, device: torch.device
                 ) -> dict[tuple[str, str, torch.dtype], str | None]:
    """Correctness of every (plan, op kind, dtype) the sweep times, outputs poisoned with NaN: None if right, else
    what failed (a plan that cannot build or launch is a failed plan). Leaves ew.TUNING and POISON_OUTPUTS as found."""
    ok: dict[tuple[str, str, torch.dtype], str | None] = {}
    saved_poison = ew.POISON_OUTPUTS
    ew.POISON_OUTPUTS = True
    try:
        for p, kinds in plans:
            for kind, dt in dict.fromkeys((c[1], c[2]) for c in sweep_cases if c[1] in kinds):
                ew.TUNING.clear()
                ew.TUNING.update(engine_tuning(p, kind))
                try:
                    ok[(p.label(), kind, dt)] = check_op(kind, dt, device)
                    torch.cuda.synchronize(device)
                except Exception as e:  # noqa: BLE001 - a plan that cannot build or launch is a failed plan
                    ok[(p.label(), kind, dt)] = f"{type(e).__name__}: {e}"
    finally:
        ew.TUNING.clear()
        ew.POISON_OUTPUTS = saved_poison
    return ok


def _anchor_cases(sweep_cases: tuple, device: torch.device, reps: int) -> list[tuple]:
    """Per case: (full name, kind, dtype, bytes, peerline calls, torch calls, torch ms, copy ms), the anchors (torch
    eager, d2d copy of the same bytes) timed first, so a budget that runs out cuts the same plans from every case."""
    cases = []
    for name, kind, dt, mib in sweep_cases:
        n = int(mib * (1 << 20)) // dt.itemsize
        nbytes, pl_calls, torch_calls = _calls(kind, dt, n, device)
        copies = max(1, min(len(torch_calls), common.ROTATE_BYTES // nbytes))
        t_torch, t_copy = common.graph_times([torch_calls, common.copy_calls(nbytes, device, copies)], device, reps)
        cases.append((f"{name} {mib:g} MiB", kind, dt, nbytes, pl_calls, torch_calls, t_torch, t_copy))
    return cases


def _time_plans(path: Path, plans: list, cases: list[tuple], ok: dict, device: torch.device, reps: int,
                budget_s: float, t0: float) -> list[dict]:
    """Plan after plan over all cases, each row written to `path` as it is made. The default runs once more at the
    end ("repeat" rows): its spread against the first timing says how large a difference between plans is noise
    (METHOD.md: time the same version twice)."""
    meta = {"device": torch.cuda.get_device_name(device),
            "l2_bytes": ew._l2_bytes(device.index or 0)}  # which cases are in the "l2" size class (plan.in_l2)
    rows: list[dict] = []
    schedule = [(p, kinds, False) for p, kinds in plans] + [(plans[0][0], frozenset(KINDS), True)]
    with path.open("w") as f:
        for i, (p, kinds, repeat) in enumerate(schedule):
            over = 0 < i and not repeat and time.monotonic() - t0 > budget_s
            log.info("sweep: plan %s%s at %.1f s%s", p.label(), " (repeat)" if repeat else "", time.monotonic() - t0,
                     " (budget spent)" if over else "")
            for case in cases:
                if case[1] not in kinds:
                    continue
                row = _plan_row(p, case, ok[(p.label(), case[1], case[2])], repeat, over, meta, device, reps)
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
    return rows


def engine_tuning(p: kp.LaunchPlan, kind: str) -> dict[str, int]:
    """The TUNING that runs `p` on the engine: the residual add ("res") runs pl_flat unless told engine=1."""
    return {**p.tuning(), **({"engine": 1} if kind == "res" else {})}


def _plan_row(p: kp.LaunchPlan, case: tuple, err: str | None, repeat: bool, over: bool, meta: dict,
              device: torch.device, reps: int) -> dict:
    """One sweep.jsonl row: the plan timed on one case (status ok / repeat), or why not (wrong, skipped, error)."""
    name, kind, _, nbytes, pl_calls, torch_calls, t_torch0, t_copy = case

    def gbps(t: float) -> float:
        return nbytes / (t * 1e-3) / 1e9

    row = {"case": name, "plan": p.label(), **asdict(p), "bytes": nbytes, "torch_GBps": gbps(t_torch0),
           "copy_GBps": gbps(t_copy), "device": meta["device"], "l2_bytes": meta["l2_bytes"]}
    if err is not None:
        row.update(status="wrong", error=err)
    elif over:
        row.update(status="skipped (budget)")
    else:
        ew.TUNING.update(engine_tuning(p, kind))
        try:
            # torch again, in rotation with the plan (benchkit.time_interleaved): vs_torch is a same-moment ratio,
            # not one against the anchor timed minutes earlier
            t_torch, t = common.graph_times([torch_calls, pl_calls], device, reps)
            row.update(status="repeat" if repeat else "ok", ms=t, GBps=gbps(t), vs_torch=t_torch / t,
                       vs_copy=t_copy / t, torch_GBps=gbps(t_torch))
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            row.update(status="error", error=f"{type(e).__name__}: {e}")
        finally:
            ew.TUNING.clear()
    return row


# case name prefix -> (elementwise op name, x dtype) of the TUNED_PLANS key (plan.parse_op_plans)
_OP_KEYS = {"bias_gelu_fwd": "bias_gelu_fwd", "bias_gelu_bwd": "bias_gelu_bwd", "residual_add": "residual_add"}


def _op_key(case: str) -> str | None:
    """'residual_add bf16+bf16 16 MiB' -> 'residual_add:bf16' (op and x's dtype, as TUNED_PLANS keys plans; the
    fp32 key also covers fp32 + bf16 residuals, which the sweep does not time); None for other case names."""
    parts = case.split()
    if len(parts) < 2 or parts[0] not in _OP_KEYS:
        return None
    return f"{_OP_KEYS[parts[0]]}:{parts[1].split('+')[0]}"


def _row_key(row: dict) -> str | None:
    """The TUNED_PLANS key of a sweep row: _op_key, plus ":l2" when the row's bytes fit in the L2 of its device
    (plan.in_l2; rows written before the sweep recorded "l2_bytes" have no size class)."""
    key = _op_key(row["case"])
    if key is not None and kp.in_l2(row.get("bytes", 0), row.get("l2_bytes", 0)):
        key += ":l2"
    return key


def tuned_choice(rows: list[dict]) -> dict[str, tuple[str, float]]:
    """Per TUNED_PLANS key (op:dtype, op:dtype:l2): the plan with the best geometric mean of vs_torch over that
    key's cases, among plans timed (status ok) on all of them, and that mean. A plan wrong on any case of the key
    never wins."""
    by_key: dict[str, dict[str, dict[str, float]]] = {}
    cases_of: dict[str, set[str]] = {}
    for r in rows:
        key = _row_key(r)
        if key is None:
            continue
        cases_of.setdefault(key, set()).add(r["case"])
        if r["status"] == "ok":
            by_key.setdefault(key, {}).setdefault(r["plan"], {})[r["case"]] = r["vs_torch"]
    wrong = {(_row_key(r), r["plan"]) for r in rows if r["status"] == "wrong"}
    out = {}
    for key, plans in by_key.items():
        full = {p: v for p, v in plans.items() if set(v) == cases_of[key] and (key, p) not in wrong}
        if full:
            best = max(full, key=lambda p: math.prod(full[p].values()) ** (1 / len(full[p])))
            out[key] = (best, math.prod(full[best].values()) ** (1 / len(full[best])))
    return out


def _short(label: str) -> str:
    """w8.s3.t0.b0.d1.v1 -> w8.s3.d1 (fields at their LaunchPlan default dropped, warps and stages kept;
    parse_plan reads either form)."""
    p, d = kp.parse_plan(label), kp.LaunchPlan()
    names = kp.PLAN_FIELDS
    keep = [f for f in p.label().split(".")
            if f[0] in "ws" or getattr(p, names[f[0]]) != getattr(d, names[f[0]])]
    return ".".join(keep)


def report_lines(rows: list[dict], default_label: str) -> list[str]:
    """SWEEP BEST per case, SWEEP TUNED per op:dtype, and the TUNED_PLANS string to paste into elementwise.py."""
    lines = [best_line(case, [r for r in rows if r["case"] == case], default_label)
             for case in dict.fromkeys(r["case"] for r in rows)]
    choice = tuned_choice(rows)
    for key, (label, gmean) in choice.items():
        cases = sorted({r["case"] for r in rows if _row_key(r) == key})
        lines.append(f"SWEEP TUNED {key}={_short(label)} ({gmean:.3f}x torch, geometric mean over {', '.join(cases)})")
    if choice:
        entries = ",".join(f"{k}={_short(v[0])}" for k, v in sorted(choice.items()))
        lines.append(f'SWEEP TUNED_PLANS = "{entries}"   (kernels/elementwise.py TUNED_PLANS, or '
                     f'PEERLINE_KERNEL_PLANS="{entries}")')
    return lines


def summarize(path: Path) -> list[str]:
    """The SWEEP BEST / TUNED lines of a sweep.jsonl (also one cut short by a time limit)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return report_lines(rows, kp.LaunchPlan().label())


def main(argv: list[str] | None = None) -> int:
    """python -m peerline.bench.kernel_tools.sweep --summarize DIR/sweep.jsonl"""
    import argparse

    ap = argparse.ArgumentParser(description="summarize a kernels sweep (run it with: python -m "
                                             "peerline.bench.suites.kernels --sweep)")
    ap.add_argument("--summarize", type=Path, required=True, help="sweep.jsonl")
    args = ap.parse_args(argv)
    if not args.summarize.is_file():
        sys.stderr.write(f"kernels_sweep: no such file {args.summarize}\n")
        return 2
    for line in summarize(args.summarize):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
