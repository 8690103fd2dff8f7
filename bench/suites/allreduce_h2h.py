"""Head-to-head rounds of the allreduce suite: peerline eager, peerline graph and torch DDP on the same model,
interleaved, so that slow drifts of the GPU (clocks, temperature, memory layout) hit every variant alike.

Each round runs every variant once, in an order shuffled from round to round (the same seed on every rank): one
untimed step, then `steps` steps timed by CUDA events on the compute stream. The figure per variant is the median
over rounds, and each round also gives a paired ratio (DDP's time / peerline's). Why shuffled, with an untimed
step: in a fixed rotation every variant always follows the same one, and the variant right after DDP pays for
what DDP leaves behind, whichever variant it is (docs/benchmarks has the measurements). "No worse than DDP" and
"better with graphs" are judged on the median paired ratio, with the number of rounds won beside it: a single
back-to-back measurement of each variant moves by several percent between runs.

Shapes: `anchor` is the suite's model (8 blocks of h=2048, the DDP anchor: GPU-bound, where a graph
can only save launch gaps); `launch` is a smaller, launch-heavy model (16 blocks of h=512, 4 microbatches of
4x256), where the host's launch work is what a graph removes and where the all-reduce has less backward to hide
behind.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.suites.allreduce_workload import (
    Shape,
    Workload,
    build_model,
    capture_step,
    free_memory,
    make_optimizer,
    step_ddp,
    step_peerline,
)
from peerline.distributed.grad_sync.buckets import GradBuckets
from peerline.distributed.streams import use

log = logging.getLogger(__name__)

SUITE = "allreduce"
VARIANTS = ("DDP", "peerline eager", "peerline graph")  # then any diagnostic variants (extra_variants)


def h2h_shapes(names: str, anchor: Shape, quick: bool) -> dict[str, Shape]:
    """'anchor,launch' -> {name: Shape}; 'none' or '' -> {} (one clear error for an unknown name)."""
    known = {"anchor": anchor,
             "launch": Shape(hidden=512, blocks=16, micro_batch=4, seq=256, microbatches=4, bucket_mb=anchor.bucket_mb,
                             first_bucket_mb=anchor.first_bucket_mb)}
    if quick:  # the CPU smoke test: the suite's tiny shape under both names
        known = {"anchor": anchor, "launch": anchor}
    picked = [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in picked if n not in known]
    if unknown:
        raise SystemExit(f"allreduce bench: error: unknown --ar-h2h-shapes {','.join(unknown)}; known: "
                         f"{', '.join(known)} or none")
    return {n: known[n] for n in picked}


def run_head_to_head(ctx: BenchContext, name: str, shape: Shape, dtype: torch.dtype, rounds: int, steps: int,
                     groups: dict[int, dist.ProcessGroup], cap: int, normal_priority: bool = False,
                     extra_caps: tuple[int, ...] = ()) -> dict[str, Any]:
    """Build both models (same weights), capture peerline's step, run `rounds` interleaved rounds; record one
    Record per peerline variant against DDP and return the summary.

    `groups` {NCCL CTA cap: dp group} (0: NCCL's default). peerline runs as the runtime does: its dp group capped
    at `cap` CTAs (RunConfig.nccl_max_ctas), the first block's buckets on the uncapped twin (the tail group), the
    all-reduce stream at the highest priority; DDP on NCCL's defaults. Diagnostic eager variants, each on a model of
    its own: NCCL's default CTAs (when `cap` is not), `normal_priority` (the all-reduce on a normal-priority
    stream, as DDP's) and each of `extra_caps`."""
    dev = ctx.device
    w = Workload(shape, dev)
    with use(w.streams.compute):
        model = build_model(shape, dtype, dev)
        ddp_model = build_model(shape, dtype, dev)
        ddp = DistributedDataParallel(ddp_model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      bucket_cap_mb=shape.bucket_mb, gradient_as_bucket_view=True,
                                      process_group=groups[0])
    opt, ddp_opt = make_optimizer(model, dev), make_optimizer(ddp, dev)
    gb = _buckets(w, model, groups, cap, w.streams.allreduce)
    steps_of: dict[str, Callable[[], Any]] = {"DDP": partial(step_ddp, w, ddp, ddp_opt),
                                              "peerline eager": partial(step_peerline, w, model, gb, opt)}
    extra_buckets = _add_diagnostic_variants(steps_of, w, dtype, groups, cap, normal_priority, extra_caps)
    for fn in steps_of.values():  # warm-up: DDP rebuilds its buckets after its first step
        with use(w.streams.compute):
            for _ in range(5):
                fn()
    graph_note = ""
    if dev.type == "cuda":
        graph = capture_step(w, model, gb, opt)
        if isinstance(graph, str):
            graph_note = graph
        else:
            steps_of["peerline graph"] = graph.replay
    names = [v for v in VARIANTS if v in steps_of] + [v for v in steps_of if v not in VARIANTS]
    per_round = _interleaved_rounds(w, steps_of, names, rounds, steps)
    for b in [gb, *extra_buckets]:
        b.close()
    summary = _summarize(per_round, names)
    sizes = {"hidden": shape.hidden, "blocks": shape.blocks, "tokens": shape.micro_batch * shape.seq,
             "microbatches": shape.microbatches, "bucket_mb": shape.bucket_mb, "dp": dist.get_world_size(),
             "params": sum(p.numel() for p in model.parameters()),
             "param_dtype": "fp32" if dtype == torch.float32 else "bf16"}
    _record(ctx, name, summary, names, rounds, steps, sizes)
    if graph_note:
        ctx.note(f"head-to-head {name}: peerline's step did not capture: {graph_note}")
    del steps_of, gb, ddp, ddp_model, model, opt, ddp_opt, w, extra_buckets
    free_memory(dev)
    return summary


def _buckets(w: Workload, model: torch.nn.Module, groups: dict[int, dist.ProcessGroup], cap: int, stream: Any
             ) -> GradBuckets:
    """GradBuckets over the model's blocks as the runtime sets them up: the dp group of `cap` CTAs, the first
    block's buckets on NCCL's default CTAs (the tail group) when capped."""
    return GradBuckets([list(b.parameters()) for b in model], groups[cap], w.device, stream, w.shape.bucket_mb,
                       w.shape.first_bucket_mb, tail_group=groups[0] if cap else None)


def _add_diagnostic_variants(steps_of: dict[str, Callable[[], Any]], w: Workload, dtype: torch.dtype,
                             groups: dict[int, dist.ProcessGroup], cap: int, normal_priority: bool,
                             extra_caps: tuple[int, ...]) -> list[GradBuckets]:
    """Add the diagnostic peerline eager variants to `steps_of`, each on a model of its own; their buckets."""
    # (the p2p role's stream: normal priority and unused in this suite; streams come only from streams.py)
    extras = [("peerline eager, NCCL default CTAs", 0, w.streams.allreduce)] if cap else []
    extras += [("peerline eager, normal-priority stream", cap, w.streams.p2p)] if normal_priority else []
    extras += [(f"peerline eager, max {c} CTAs", c, w.streams.allreduce) for c in extra_caps if c and c != cap]
    made = []
    for label, c, stream in extras:
        with use(w.streams.compute):
            model_x = build_model(w.shape, dtype, w.device)
        gb_x = _buckets(w, model_x, groups, c, stream)
        made.append(gb_x)
        steps_of[label] = partial(step_peerline, w, model_x, gb_x, make_optimizer(model_x, w.device))
    return made


def _record(ctx: BenchContext, name: str, summary: dict[str, dict[str, Any]], names: list[str], rounds: int,
            steps: int, sizes: dict[str, Any]) -> None:
    """One record per peerline variant against DDP, with the per-round times and the paired ratios."""
    for v in names[1:]:
        s = summary[v]
        ctx.record(Record(SUITE, f"head-to-head {name}: {v} step vs DDP", "ms/iter", s["median_ms"],
                          summary["DDP"]["median_ms"], "torch DDP eager, same model, interleaved rounds",
                          higher_is_better=False, sizes=sizes,
                          extra={"rounds": rounds, "steps_per_round": steps, "paired_ratio_median": s["ratio"],
                                 "paired_ratio_min": s["ratio_min"], "paired_ratio_max": s["ratio_max"],
                                 "rounds_won": s["won"], "round_ms": s["round_ms"],
                                 "ddp_round_ms": summary["DDP"]["round_ms"],
                                 "runtime_setting": v in VARIANTS,  # else a diagnostic variant
                                 "ratio_is": "DDP ms / peerline ms in the same round (> 1: peerline faster)"}))


def _interleaved_rounds(w: Any, steps_of: dict[str, Callable[[], Any]], names: list[str], rounds: int,
                        steps: int) -> list[dict[str, float]]:
    """ms per step of each variant in each round (the slowest rank's); the order is shuffled every round by a seed
    every rank shares (identical NCCL sequences), and each variant's timed steps follow one untimed step of its
    own, so what the previous variant left behind (queued work, cache and allocator state) is not charged to it."""
    cuda = w.device.type == "cuda"
    rows: list[dict[str, float]] = []
    for r in range(rounds):
        order = list(names)
        random.Random(1000 + r).shuffle(order)
        marks: dict[str, Any] = {}
        with use(w.streams.compute):
            for v in order:
                steps_of[v]()  # untimed: absorbs the switch from the previous variant
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                for _ in range(steps):
                    steps_of[v]()
                if cuda:
                    end.record()
                    marks[v] = (start, end)
                else:
                    marks[v] = (time.perf_counter() - t0) * 1e3
        if cuda:
            torch.cuda.synchronize(w.device)
            ms = [marks[v][0].elapsed_time(marks[v][1]) / steps for v in names]
        else:
            ms = [marks[v] / steps for v in names]
        t = torch.tensor(ms, dtype=torch.float64, device=w.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append(dict(zip(names, t.tolist(), strict=True)))
    return rows


def _summarize(rows: list[dict[str, float]], names: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for v in names:
        round_ms = [row[v] for row in rows]
        ratios = [row["DDP"] / row[v] for row in rows]
        out[v] = {"median_ms": statistics.median(round_ms), "round_ms": round_ms, "ratio": statistics.median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios), "won": sum(x > 1.0 for x in ratios)}
    return out


def goal_lines(ctx: BenchContext) -> list[str]:
    """The step goals from the head-to-head records: eager no worse than DDP, graph better than DDP, each by
    the median paired ratio (rounds won beside it)."""
    lines = []
    for r in ctx.records:
        if not r.case.startswith("head-to-head "):
            continue
        e = r.extra
        if not e["runtime_setting"]:
            continue  # diagnostic variants
        graph = "graph" in r.case
        met = e["paired_ratio_median"] > 1.0 if graph else e["paired_ratio_median"] >= 1.0
        want = "better than DDP" if graph else "no worse than DDP"
        lines.append(f"GOAL {'MET' if met else 'MISSED'} {SUITE} {r.case} ({want}): {r.peerline:.2f} vs "
                     f"{r.anchor:.2f} ms, DDP/peerline per round: median {e['paired_ratio_median']:.3f} (min "
                     f"{e['paired_ratio_min']:.3f}, max {e['paired_ratio_max']:.3f}), won {e['rounds_won']} of "
                     f"{e['rounds']} rounds")
    return lines
