"""Verdicts on the results of GPU runs, as lists of problems (empty: the run passes).

`run_problems`: a --json result of launch/pipeline.py against its single-process reference: per-iteration losses
and every layer's parameter checksums within rtol (tests/helpers.worst_difference), and what the loss check does
not look at: the world size, one set of checksums per replica covering exactly the reference's layers (a run that
lost a stage's layers would otherwise compare only the layers it has), whether the run really was captured into a
graph or not (a silent eager fallback passes the loss check) and the transport it used.
`bench_problems` / `timeline_problems`: the pipeline suite's records and timelines of one run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import comparison_line, worst_difference

# launch/bench.py's pipeline configurations -> the shape name its records carry
SHAPE_NAMES = {"compute": "compute-bound", "launch": "launch-bound", "quick": "quick"}


@dataclass(frozen=True)
class Expect:
    """What a run must show against its reference: rtol on losses and checksums, the world size, the replicas
    (dp), the graph state (None: either) and a transport name prefix ("": any)."""

    rtol: float
    world: int = 1
    dp: int = 1
    graph: bool | None = None
    transport: str = ""


def _layout_problems(got: dict, ref: dict, want: Expect) -> list[str]:
    problems = []
    if not (len(got.get("losses", [])) == len(ref.get("losses", [])) > 0):
        problems.append(f"{len(got.get('losses', []))} losses vs {len(ref.get('losses', []))}")
    if not all(math.isfinite(v) for v in got.get("losses", [])):  # a NaN loss compares as no difference
        problems.append(f"non-finite losses {got.get('losses')}")
    if got.get("world_size") != want.world:
        problems.append(f"world size {got.get('world_size')}, expected {want.world}")
    ref_layers = {k.split("/")[1] for k in ref.get("layer_checksums", {})}
    keys = list(got.get("layer_checksums", {}))
    replicas = {k.split("/")[0] for k in keys}
    if replicas != {f"r{r}" for r in range(want.dp)}:
        problems.append(f"checksums of replicas {sorted(replicas)}, expected r0..r{want.dp - 1}")
    for rep in sorted(replicas):
        layers = {k.split("/")[1] for k in keys if k.startswith(rep + "/")}
        if layers != ref_layers or not layers:
            problems.append(f"{rep} has layers {sorted(layers)}, reference {sorted(ref_layers)}")
    if want.graph is not None and bool(got.get("graph")) != want.graph:
        problems.append(f"graph={got.get('graph')}, expected {want.graph} (the run's log says why)")
    if want.transport and not str(got.get("transport", "")).startswith(want.transport):
        problems.append(f"transport {got.get('transport')!r}, expected {want.transport}")
    return problems


def run_problems(got: dict, ref: dict, want: Expect) -> tuple[list[str], str]:
    """(problems, detail line) of one run against its reference; see the module docstring."""
    problems = _layout_problems(got, ref, want)
    try:  # compared even beside other problems (the figure helps), unless the layers do not line up
        has_layers = bool(ref.get("layer_checksums"))
        worst, where = worst_difference(got, ref) if has_layers else (math.inf, "no reference layers")
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        worst, where = math.inf, f"not comparable ({type(exc).__name__}: {exc})"
    if not worst <= want.rtol:
        problems.append(f"worst relative difference {worst:.3g} > {want.rtol:g}")
    return problems, comparison_line(got, ref, worst, where, want.rtol)


def assert_matches(got: dict, ref: dict, want: Expect) -> None:
    """Fail with the detail line and every problem unless the run matches its reference."""
    problems, line = run_problems(got, ref, want)
    assert not problems, f"{'; '.join(problems)}\n{line}"


def bench_problems(records: list[dict], configs: list[str], variants: list[str], schedule: str = "1f1b"
                   ) -> list[str]:
    """Every record has a finite ratio, and every (configuration, variant) asked for has a record."""
    by_case = {r.get("case"): r for r in records}
    problems = [] if records else ["no records"]
    for r in records:
        ratio = r.get("ratio")
        if ratio is None or not math.isfinite(ratio):
            problems.append(f"non-finite ratio in {r.get('case')!r}: {ratio}")
    for cfg in configs:
        for variant in variants:
            case = f"{SHAPE_NAMES.get(cfg, cfg)} {schedule} {variant}"
            if case not in by_case:
                problems.append(f"missing record {case!r} (have {sorted(map(str, by_case))})")
    return problems


def read_records(path: Path) -> list[dict]:
    """The JSON lines of a results.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timeline_problems(results: Path, configs: int) -> list[str]:
    """One Chrome trace per configuration, each reported consistent with the pipeline's dependencies in
    results.md (observe/timeline_check.py)."""
    traces = len(list(results.glob("timeline-*.json")))
    md = results / "results.md"
    consistent = md.read_text().count("spans, consistent") if md.exists() else 0
    if traces >= configs and consistent >= configs:
        return []
    return [f"timelines: {traces} traces, {consistent} consistent, of {configs} configurations"]
