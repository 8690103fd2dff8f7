"""Tune the kernels for the card this runs on and write its entry of kernels/card_plans.json.

    python -m peerline.bench.kernel_tools.tune [--sizes-mib 1,4,16,64,256] [--candidates 3] [--reps 10]
        [--dry-run] [--table PATH]

For each op and dtype (bias+GELU forward and backward, residual add; bf16 and fp32) and each size: torch's op and
the candidate plans (the plans in use for that op, then the first --candidates plans of sweep.SWEEP_PLANS for its
kind), each checked against float64 first (sweep.check_op, outputs poisoned; a wrong plan is never timed), timed
on the device: each op captured 10 times into a CUDA graph, its replays in rotation with torch's
(common.graph_times, an L2 scrub before each). Per plan key (op:dtype, and op:dtype:l2 for sizes in the L2 size
class) the plan with the best geometric mean of its speed-up over torch wins (sweep.tuned_choice); per size the
winner of that plan against torch is the size's verdict (torch where torch is faster: the kernels are then never
slower under --kernels auto). Host cost per launch (host_cost.py) sets each op's eager threshold: the bytes where
the kernel's device-time lead reaches its extra host time. Prints TUNE lines; writes the entry unless --dry-run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from peerline.bench.kernel_tools import common, host_cost, sweep
from peerline.kernels import card_table
from peerline.kernels import elementwise as ew
from peerline.kernels import plan as kp

log = logging.getLogger(__name__)

CASES = (("bias_gelu_fwd", "fwd"), ("bias_gelu_bwd", "bwd"), ("residual_add", "res"))
DTYPES = (torch.bfloat16, torch.float32)
SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32"}
CALLS_PER_GRAPH = 10
HOST_ROWS, HOST_HIDDEN = 512, 512


def candidates(kind: str, op: str, dtype: torch.dtype, device_index: int, extra: int) -> list[kp.LaunchPlan]:
    """The plans in use for (op, dtype) (both size classes), then `extra` more of the sweep's for this kind. The
    residual add runs pl_flat whatever the plan says: one plan, the default, times it against torch."""
    if kind == "res":
        return [kp.LaunchPlan()]
    plans = ew.op_plans(device_index)
    out = [p for p in (kp.op_plan(plans, op, SHORT[dtype], l2) for l2 in (True, False)) if p is not None]
    out.append(kp.LaunchPlan())
    for text in sweep.SWEEP_PLANS:
        label, kinds = sweep.parse_sweep_plan(text)
        if len(out) >= 2 + extra + 1:
            break
        if kind in kinds:
            out.append(kp.parse_plan(label))
    return list(dict.fromkeys(out))


def _ten(calls: list) -> list:
    return [calls[i % len(calls)] for i in range(CALLS_PER_GRAPH)]


def time_case(op: str, kind: str, dtype: torch.dtype, mib: float, plans: list[kp.LaunchPlan],
              device: torch.device, reps: int, l2_bytes: int) -> list[dict]:
    """Sweep-format rows (case, plan, status, vs_torch, bytes, l2_bytes, ms, torch_ms) of every plan at one size."""
    n = max(common.HIDDEN, int(mib * (1 << 20)) // dtype.itemsize // common.HIDDEN * common.HIDDEN)
    nbytes, pl_calls, torch_calls = sweep._calls(kind, dtype, n, device)
    pl_calls, torch_calls = _ten(pl_calls), _ten(torch_calls)
    name = f"{op} {SHORT[dtype]}{'+' + SHORT[dtype] if kind == 'res' else ''} {mib:g} MiB"
    rows = []
    for p in plans:
        ew.TUNING.clear()
        ew.TUNING.update(p.tuning())
        try:
            t_torch, t = common.graph_times([torch_calls, pl_calls], device, reps)
            rows.append({"case": name, "plan": p.label(), "status": "ok", "vs_torch": t_torch / t, "ms": t,
                         "torch_ms": t_torch, "bytes": nbytes, "l2_bytes": l2_bytes})
        except Exception as exc:  # noqa: BLE001 - recorded; the plan loses
            rows.append({"case": name, "plan": p.label(), "status": "error", "error": str(exc), "bytes": nbytes,
                         "l2_bytes": l2_bytes})
        finally:
            ew.TUNING.clear()
    return rows


def verdicts(rows: list[dict], chosen: dict[str, tuple[str, float]]) -> dict[str, list[list]]:
    """op:dtype -> [[bytes, winner], ...]: the chosen plan of each size's class against torch at that size."""
    out: dict[str, list[list]] = {}
    for r in rows:
        key = sweep._row_key(r)
        if key is None or r["status"] != "ok" or key not in chosen or chosen[key][0] != r["plan"]:
            continue
        base = key.removesuffix(":l2")
        out.setdefault(base, []).append([r["bytes"], card_table.PEERLINE if r["vs_torch"] >= 1.0 else card_table.TORCH])
    return {k: sorted(v) for k, v in out.items()}


def eager_threshold(extra_host_us: float, points: list[tuple[int, float]]) -> int:
    """Bytes from which the device time saved per launch (torch ms - kernel ms at each timed size, extrapolated
    linearly past the largest) reaches the kernel's extra host time; 0 when the kernel costs no more host time."""
    if extra_host_us <= 0:
        return 0
    for nbytes, saved_us in sorted(points):
        if saved_us >= extra_host_us:
            return nbytes
    nbytes, saved_us = max(points) if points else (0, 0.0)
    return int(nbytes * extra_host_us / saved_us) if saved_us > 0 else 1 << 62


def host_extra(device: torch.device) -> dict[str, float]:
    """op -> host microseconds a peerline launch costs beyond torch's equivalent (bf16, HOST_ROWS x HOST_HIDDEN)."""
    pairs = host_cost.op_pairs(torch.bfloat16, HOST_ROWS, HOST_HIDDEN, device)
    cases = {"bias_gelu_fwd": "bias_gelu fwd (autograd)", "bias_gelu_bwd": "bias_gelu bwd (raw launch)",
             "residual_add": "residual_add fwd (autograd)"}
    out = {}
    for op, case in cases.items():
        pl, torch_fn = pairs[case]
        out[op] = host_cost.host_us(pl, device) - host_cost.host_us(torch_fn, device)
    return out


def tune(device: torch.device, sizes_mib: list[float], extra: int, reps: int) -> tuple[str, dict]:
    """(card name, its table entry)."""
    index = device.index or 0
    card, l2 = torch.cuda.get_device_name(index), ew._l2_bytes(index)
    rows: list[dict] = []
    t0 = time.monotonic()
    for op, kind in CASES:
        for dt in DTYPES:
            plans = candidates(kind, op, dt, index, extra)
            ok = sweep._check_plans([(p, frozenset({kind})) for p in plans], ((op, kind, dt, 1),), device)
            good = [p for p in plans if ok[(p.label(), kind, dt)] is None]
            for p in plans:
                if ok[(p.label(), kind, dt)] is not None:
                    sys.stdout.write(f"TUNE WRONG {op} {SHORT[dt]} {p.label()}: {ok[(p.label(), kind, dt)]}\n")
            for mib in sizes_mib:
                rows += time_case(op, kind, dt, mib, good, device, reps, l2)
            torch.cuda.empty_cache()
            log.info("tune: %s %s done at %.0f s", op, SHORT[dt], time.monotonic() - t0)
    chosen = sweep.tuned_choice(rows)
    points = verdicts(rows, chosen)
    extra_us = host_extra(device)
    below = {}
    for op, _ in CASES:
        saved = [(r["bytes"], (r["torch_ms"] - r["ms"]) * 1e3) for r in rows
                 if r["status"] == "ok" and r["case"].startswith(op + " bf16") and sweep._row_key(r) in chosen
                 and chosen[sweep._row_key(r)][0] == r["plan"]]
        below[op] = eager_threshold(extra_us[op], saved)
    entry = {"plans": ",".join(f"{k}={sweep._short(v[0])}" for k, v in sorted(chosen.items())),
             "choice": points, "eager_torch_below": below, "host_us": extra_us,
             "tuned": {k: [sweep._short(v[0]), round(v[1], 4)] for k, v in chosen.items()},
             "sizes_mib": list(sizes_mib), "rows": [{k: r[k] for k in ("case", "plan", "status") if k in r}
                                                     | {"vs_torch": round(r.get("vs_torch", 0.0), 4)} for r in rows]}
    return card, entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tune the kernels' plans and the torch fallback for this card")
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="MiB of x, comma-separated")
    ap.add_argument("--candidates", type=int, default=3, help="sweep plans per op kind besides the plans in use")
    ap.add_argument("--reps", type=int, default=10, help="timed replays per plan and size")
    ap.add_argument("--dry-run", action="store_true", help="print the entry, do not write the table")
    ap.add_argument("--table", type=Path, default=card_table.TABLE_FILE, help="the table file to update")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        sizes = [float(v) for v in args.sizes_mib.split(",") if v.strip()]
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"--sizes-mib needs sizes > 0, got {args.sizes_mib!r}")
    except ValueError as exc:
        sys.stderr.write(f"tune: error: {exc}\n")
        return 2
    if not torch.cuda.is_available():
        sys.stderr.write("tune: error: needs a CUDA device\n")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    card, entry = tune(device, sizes, args.candidates, args.reps)
    for key, (label, gmean) in sorted(entry["tuned"].items()):
        sys.stdout.write(f"TUNE {card}: {key}={label} ({gmean:.3f}x torch, geometric mean)\n")
    for key, pts in sorted(entry["choice"].items()):
        sys.stdout.write(f"TUNE {card}: {key} " + ", ".join(f"{b / (1 << 20):g} MiB moved -> {w}" for b, w in pts)
                         + "\n")
    sys.stdout.write(f"TUNE {card}: eager torch below (bytes) {entry['eager_torch_below']}; extra host us "
                     f"{ {k: round(v, 2) for k, v in entry['host_us'].items()} }\n")
    if not args.dry_run:
        card_table.write_entry(card, entry, args.table)
        sys.stdout.write(f"TUNE wrote {card!r} into {args.table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
