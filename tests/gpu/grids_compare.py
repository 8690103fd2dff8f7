"""Checks for the 4-GPU grid section (tests/gpu/run_grids.sh, issue 11).

    python tests/gpu/grids_compare.py run RESULT.json REFERENCE.json --rtol 1e-5 --world 4 --dp 2 \
        [--graph on|off] [--transport copy-engine]
    python tests/gpu/grids_compare.py bench RESULTS.jsonl --grid "pp=4 x dp=1" --configs compute,launch \
        --variants eager,graph

`run`: a --json result of launch/pipeline.py against the single-process reference (per-iteration losses and every
layer's checksums within rtol, as tests/gpu/compare_runs.py), and what compare_runs.py does not look at: the world
size, one set of layer checksums per replica covering exactly the reference's layers (a pp=4 run that lost a
stage's layers would otherwise compare only the layers it has), and, on a GPU, whether the run really was captured
into a graph (or not) and went over the transport asked for (a silent eager fallback would pass the loss check).
Prints one detail line; exit 1 on any mismatch.

`bench`: the pipeline suite's records of one grid: every (configuration, variant) asked for is there with a finite
ratio; prints one `GOAL-INFO` line per record (tokens/s against torch.distributed.pipelining and the distance to
the bubble-aware ideal time) so that run.sh's summary (lines starting with GOAL) carries the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# Run as a script from anywhere: the checkout root holds the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import comparison_line, worst_difference  # noqa: E402

SHAPE_NAMES = {"compute": "compute-bound", "launch": "launch-bound", "quick": "quick"}


def check_run(a: argparse.Namespace) -> int:
    """One grid run against its reference; see the module docstring."""
    try:
        got, ref = (json.loads(Path(x).read_text()) for x in (a.result, a.reference))
    except (OSError, ValueError) as exc:
        print(f"cannot read results ({exc})")
        return 1
    problems: list[str] = []
    if not (len(got.get("losses", [])) == len(ref.get("losses", [])) > 0):
        problems.append(f"{len(got.get('losses', []))} losses vs {len(ref.get('losses', []))}")
    if got.get("world_size") != a.world:
        problems.append(f"world size {got.get('world_size')}, expected {a.world}")
    ref_layers = {k.split("/")[1] for k in ref.get("layer_checksums", {})}
    keys = list(got.get("layer_checksums", {}))
    replicas = {k.split("/")[0] for k in keys}
    if replicas != {f"r{r}" for r in range(a.dp)}:
        problems.append(f"checksums of replicas {sorted(replicas)}, expected r0..r{a.dp - 1}")
    for rep in sorted(replicas):
        layers = {k.split("/")[1] for k in keys if k.startswith(rep + "/")}
        if layers != ref_layers or not layers:
            problems.append(f"{rep} has layers {sorted(layers)}, reference {sorted(ref_layers)}")
    if a.graph is not None and bool(got.get("graph")) != (a.graph == "on"):
        problems.append(f"graph={got.get('graph')}, expected {a.graph} (see the run's log for the reason)")
    if a.transport and not str(got.get("transport", "")).startswith(a.transport):
        problems.append(f"transport {got.get('transport')!r}, expected {a.transport}")
    try:  # compared even beside other problems (the figure helps), unless the layers do not line up
        worst, where = worst_difference(got, ref) if ref_layers else (math.inf, "no reference layers")
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        worst, where = math.inf, f"not comparable ({type(exc).__name__}: {exc})"
    if worst > a.rtol:
        problems.append(f"worst relative difference {worst:.3g} > {a.rtol:g}")
    print(comparison_line(got, ref, worst, where, a.rtol) + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ""))
    return 1 if problems else 0


def check_bench(a: argparse.Namespace) -> int:
    """The records of one grid's pipeline suite run; see the module docstring."""
    try:
        recs = [json.loads(line) for line in Path(a.results).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        print(f"FAIL-DETAIL cannot read {a.results} ({exc})")
        return 1
    by_case = {r["case"]: r for r in recs}
    missing, bad = [], []
    for cfg in a.configs.split(","):
        shape = SHAPE_NAMES.get(cfg, cfg)
        for variant in a.variants.split(","):
            case = f"{shape} 1f1b {variant}"
            rec = by_case.get(case)
            if rec is None:
                missing.append(case)
                continue
            ratio = rec.get("ratio")
            if ratio is None or not math.isfinite(ratio):
                bad.append(case)
            x = rec.get("extra", {})
            ideal, anchor_ideal = x.get("ideal") or {}, x.get("anchor_ideal") or {}
            print(f"GOAL-INFO grids {a.grid}: {case}: {rec['peerline']:.4g} tokens/s = {ratio:.3f}x "
                  f"{rec['anchor_name']} ({x.get('ms_per_iter', math.nan):.2f} vs "
                  f"{x.get('anchor_ms_per_iter', math.nan):.2f} ms/iter); ideal: achieved "
                  f"{ideal.get('achieved_ms', math.nan):.2f} ms, bound {ideal.get('bound_ms', math.nan):.2f} "
                  f"(ratio {ideal.get('ratio', math.nan):.3f}; torch's {anchor_ideal.get('ratio', math.nan):.3f})")
    if missing or bad:
        print(f"FAIL-DETAIL grids {a.grid}: missing records {missing}, non-finite ratios {bad}; "
              f"have {sorted(by_case)}")
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="one grid run against the single-process reference")
    r.add_argument("result")
    r.add_argument("reference")
    r.add_argument("--rtol", type=float, required=True)
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--dp", type=int, required=True)
    r.add_argument("--graph", choices=("on", "off"), default=None, help="expected graph state (GPU runs)")
    r.add_argument("--transport", default="", help="expected transport prefix, e.g. copy-engine (GPU runs)")
    b = sub.add_parser("bench", help="one grid's pipeline suite records")
    b.add_argument("results")
    b.add_argument("--grid", required=True)
    b.add_argument("--configs", required=True)
    b.add_argument("--variants", required=True)
    a = p.parse_args()
    return check_run(a) if a.what == "run" else check_bench(a)


if __name__ == "__main__":
    sys.exit(main())
