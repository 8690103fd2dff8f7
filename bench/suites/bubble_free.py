"""The pipeline suite's bubble-free time: one GPU running the whole model of a configuration (1F1B, one stage, the
fastest peerline variant's recipe and graph setting), divided by pp. A pipeline of pp GPUs can at best divide that
work pp ways; its fraction of the bound is the schedules issue's measure of the bubble and of the pipeline's other
costs (transfers, waits, imbalance between ranks). Measured in a fresh process on rank 0's GPU
(bench/suites/fresh_child.py) while the other ranks wait. The record also names the schedule's own ceiling: the
share of the bubble-free time its fill and drain allow with balanced stages and free transfers (bench/ideal.py
schedule_bubble), below 1 for every schedule (the last rank waits for the first forward to reach it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record, Timing
from peerline.bench.ideal import schedule_bubble, stages_per_rank
from peerline.bench.runtime_timing import Measured, open_runtime, time_captured
from peerline.bench.suites.fresh_child import child_device, child_spec, child_timer, on_rank0, run_fresh_child
from peerline.bench.suites.torch_pipelining import PipeShape
from peerline.choices import DEFAULT_ZB_ORDER

#: the schedules issue's goal: a pipeline's time within this fraction of the bubble-free time
GOAL = 0.95
LOSS_CHECK_ITERS = 2


def bubble_free_child(spec: dict[str, Any], out_path: str) -> None:
    """In its own process (one rank, the first visible device): the whole model of spec["shape"] as one stage,
    timed with the bench's counts; writes {"timing", "losses", "graph"} (or {"skipped": why}) to `out_path`."""
    from peerline.distributed.config import RunConfig

    device = child_device()
    s = PipeShape(**spec["shape"])
    graph = bool(spec["graph"]) and device.type == "cuda"
    cfg = RunConfig(schedule="1f1b", stages=1, microbatches=s.microbatches, micro_batch_size=s.micro_batch_size,
                    seq=s.seq, hidden=s.hidden, layers=s.layers, seed=s.seed, lr=s.lr, dtype=s.dtype,
                    precision=spec["precision"], device=device.type, graph=graph, iters=10**9, log_every=1)
    with open_runtime(cfg) as rt:
        measured = time_captured(rt, graph, LOSS_CHECK_ITERS, child_timer(spec, device))
    if isinstance(measured, str):
        result: dict[str, Any] = {"skipped": measured}
    else:
        losses, timing = measured
        result = {"timing": dataclasses.asdict(timing), "losses": losses, "graph": graph}
    Path(out_path).write_text(json.dumps(result))


def measure(args: argparse.Namespace, ctx: BenchContext, key: str, shape: PipeShape, best: Measured
            ) -> Measured | str:
    """Rank 0 runs bubble_free_child for `shape` with `best`'s recipe and graph setting while every rank waits;
    every rank gets the one-GPU measurement ("one GPU"), or why there is none."""
    spec = {**child_spec(args, ctx.quick, getattr(args, "pipeline_iters", None)), "shape": dataclasses.asdict(shape),
            "precision": best.extra.get("precision", "master"), "graph": best.name.startswith("graph")}
    path = Path(ctx.out_dir) / f"bubble_free_{key}.json"
    shared = [on_rank0(lambda: run_fresh_child(ctx, f"{__name__}:bubble_free_child", spec, path))]
    dist.broadcast_object_list(shared, src=0)
    got = shared[0]
    if isinstance(got, str) or got is None:
        return f"the one-GPU process failed: {got}"
    if "skipped" in got:
        return str(got["skipped"])
    return Measured("one GPU", Timing(**got["timing"]), list(got["losses"]), None, 0.0,
                    {"graph": got["graph"], "precision": spec["precision"]})


def schedule_ceiling(label: str, shape: PipeShape, pp: int, order: str = DEFAULT_ZB_ORDER) -> float:
    """The share of the bubble-free time that the schedule of variant `label` ("zbv graph bf16") reaches at best in
    the rank order `order` (--zb-order): balanced stages, forward : backward = 1 : 2, free transfers."""
    schedule = label.split()[0]
    return 1.0 - schedule_bubble(schedule, shape.microbatches, pp, stages_per_rank(schedule, pp, shape.layers),
                                 order)


def record(ctx: BenchContext, shape: PipeShape, pp: int, dp: int, label: str, best: Measured, one: Measured
           ) -> None:
    """`<configuration> best vs bubble-free`: the fastest peerline variant's ms/iter against the one-GPU time / pp,
    with its schedule's ceiling; on a GPU, the goal line."""
    one_ms = one.timing.median_ms
    ceiling = schedule_ceiling(label, shape, pp, best.extra.get("zb_order", DEFAULT_ZB_ORDER))
    rec = ctx.record(Record("pipeline", f"{shape.name} best vs bubble-free", "ms/iter", best.timing.median_ms,
                            one_ms / pp, f"one GPU running the whole model ({one_ms:.2f} ms, 1F1B, one stage), / pp",
                            higher_is_better=False, sizes={**shape.sizes(), "pp": pp, "dp": dp},
                            extra={"peerline_best": label, "one_gpu_ms": one_ms, "one_gpu_spread": one.timing.spread,
                                   "one_gpu_losses": one.losses, "one_gpu_graph": one.extra["graph"],
                                   "precision": one.extra["precision"], "losses": best.losses,
                                   "schedule_ceiling": ceiling}))
    ctx.note(f"pipeline {shape.name} pp={pp}: {label.split()[0]} at M={shape.microbatches} reaches at most "
             f"{ceiling:.3f} of the bubble-free time (its fill and drain with balanced stages, forward : backward "
             f"1 : 2, free transfers); the best variant is at {rec.ratio:.3f}, {rec.ratio / ceiling:.3f} of that")
    if ctx.device.type == "cuda":
        ctx.note(f"GOAL {'MET' if rec.ratio >= GOAL else 'MISSED'} pipeline {shape.name} best: peerline {label} "
                 f"at {rec.ratio:.3f} of the bubble-free time (goal >= {GOAL})")
