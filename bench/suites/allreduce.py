"""allreduce suite: peerline's bucketed all-reduce (GradBuckets) overlapped with backward, next to torch DDP on the
same model, bucket size and optimizer, in the same run, at several NCCL CTA caps.

Run under torchrun with 2 ranks (`torchrun --nproc_per_node=2 bench/suites/allreduce.py --out DIR`).
Model: peerline's default block stack (allreduce_workload.py: LayerNorm -> Linear h->4h, no bias -> + bias,
GELU -> Linear 4h->h -> residual), 8 blocks of h=2048 (268.6 M parameters), bf16 autocast, fused AdamW
(capturable), MSE loss. Per parameter dtype (fp32 params: 1 GiB of fp32 gradients, what the engine runs; bf16
params: 512 MiB, the DDP anchor's setting):

  local      one step without any gradient sync: the compute time the all-reduce has to hide behind
  peerline   GradBuckets (25 MiB buckets, 1 MiB first), all-reduce stream of the highest priority, eager
  graph      the same step captured whole in a CUDA graph and replayed
  DDP        DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=True), eager
  alone      the same bucket buffers all-reduced back to back after backward (same sizes, same NCCL sequence,
             nothing else on the GPU): the bus bandwidth of the bucket layout itself
  plain      a lone NCCL all-reduce of each bucket size, repeated
  head-to-head  peerline eager / graph / DDP interleaved round by round, on this model and a launch-heavy one
             (allreduce_h2h.py): the step-time goals are judged there, on paired ratios

CTA caps (`--ar-nccl-ctas-sweep`, default 0,16,8,4; 0 = NCCL's default): NCCL kernels on the highest-priority
stream take SMs from the backward GEMMs they overlap with. For each cap the dp group is created with
`nccl_options(max_ctas=cap)` (buckets.py) and peerline is measured on it; DDP is measured with NCCL's default
and with each cap (fair: DDP could use the cap too). The headline cap (`--ar-nccl-max-ctas`, default: the runtime's
RunConfig.nccl_max_ctas, 16; auto = the cap with the fastest peerline eager step in this run) gets the GOAL lines;
every cap gets a SWEEP line.
With a cap, the buckets of the first block (backward finishes it last: nothing is left to overlap their
all-reduce with) run on NCCL's default CTAs (GradBuckets' tail_group), unless `--ar-no-tail-group`.
`--ar-normal-priority` adds peerline on a normal-priority stream (NCCL's default CTAs), as DDP runs its all-reduce.

Reported: step time (max over ranks), exposed all-reduce (peerline: CUDA events from the end of the last
backward kernel to the optimizer's start; DDP: its step minus the local step), the share of the all-reduce hidden
behind backward, and bus bandwidth per bucket size: alone (the goal's measure: >= 90% of plain) and inside the
overlapped step. A bucket's time is per rank from its start event to its end event; both ranks finish an
all-reduce together, so the rank that started it later has the shorter time: taking the minimum over ranks times
it from the later rank's start (skew between ranks excluded). Inside the step that is still the time shared with
backward kernels, so in-step busbw understates the layout's bandwidth.
Goals: >= 90% hidden, <= 0.25 ms exposed, bucket busbw >= 90% of plain, step no worse than DDP.
`--quick` (or ctx.quick): a tiny model on the CPU with gloo, as a smoke test (caps are ignored by gloo).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peerline.bench.benchkit import BenchContext, Record, Timing, time_fn
from peerline.bench.suites.allreduce_h2h import goal_lines as h2h_goal_lines
from peerline.bench.suites.allreduce_h2h import h2h_shapes, run_head_to_head
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
from peerline.distributed.config import RunConfig
from peerline.distributed.grad_sync.buckets import GradBuckets, MiB, nccl_options
from peerline.distributed.streams import use

log = logging.getLogger(__name__)
SUITE = "allreduce"


def over_ranks(values: list[float], device: torch.device, op: dist.ReduceOp,
               group: dist.ProcessGroup | None = None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def max_over_ranks(value: float, device: torch.device) -> float:
    return over_ranks([value], device, dist.ReduceOp.MAX)[0]


def later_start_ms(rows: list[list[float]], device: torch.device, group: dist.ProcessGroup | None) -> list[float]:
    """Per-bucket time from the later rank's start: rows[sample][bucket] are this rank's start->end times. Both
    ranks end an all-reduce together, so the minimum over ranks excludes the wait for the other rank (skew);
    then the median over samples."""
    flat = over_ranks([v for row in rows for v in row], device, dist.ReduceOp.MIN, group)
    nb = len(rows[0])
    return [statistics.median(flat[s * nb + i] for s in range(len(rows))) for i in range(nb)]


def median_metrics(samples: list[dict[str, Any]], device: torch.device, group: dist.ProcessGroup | None
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples)
                           for k in ("allreduce_ms", "exposed_ms", "hidden_share")}
    if samples[0].get("bucket_ms") is not None:
        rows = [s["bucket_ms"] for s in samples]
        out["bucket_ms"] = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]  # this rank's
        out["bucket_ms_later_start"] = later_start_ms(rows, device, group)
    return out


def cap_name(cap: int) -> str:
    return "nccl default CTAs" if cap == 0 else f"max {cap} CTAs"


def make_group(cap: int, device: torch.device) -> dist.ProcessGroup:
    """The dp group (here: the world) with NCCL's CTAs capped at `cap` (0: NCCL's default, the world group)."""
    if cap == 0 or device.type != "cuda":
        return dist.group.WORLD
    return dist.new_group(list(range(dist.get_world_size())), pg_options=nccl_options(max_ctas=cap))


def measure_peerline(w: Workload, model: torch.nn.Module, gb: GradBuckets, opt: torch.optim.Optimizer,
                     warmup: int, reps: int, graph: bool) -> dict[str, Any]:
    dev = w.device
    res: dict[str, Any] = {"eager": w.time(partial(step_peerline, w, model, gb, opt), warmup, reps)}
    samples = []
    for _ in range(max(3, reps // 2)):
        with use(w.streams.compute):
            step_peerline(w, model, gb, opt)
        samples.append(gb.metrics())
    res["metrics"] = median_metrics(samples, dev, gb.group)
    res["launched_in_backward"] = samples[-1]["launched_in_backward"]
    res["alone_ms"] = measure_alone(w, gb, max(3, reps // 2))
    if graph and dev.type == "cuda":
        res.update(measure_graph(w, model, gb, opt, reps))
    return res


def measure_alone(w: Workload, gb: GradBuckets, reps: int) -> list[float]:
    """Each bucket's all-reduce with nothing else running: the bucket buffers all-reduced back to back, in launch
    order, on the all-reduce stream and gb's group (the same sizes and NCCL sequence as in the step). Per bucket,
    ms from the later rank's start, median over `reps` rounds after one warm-up round."""
    cuda = w.device.type == "cuda"
    op = dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM  # values are only timed here; gloo has no AVG
    tensors = gb.bucket_tensors
    if cuda:
        torch.cuda.synchronize(w.device)
    dist.barrier(group=gb.group)
    rows: list[list[float]] = []
    with use(w.streams.allreduce):
        if cuda:
            events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in tensors]
                      for _ in range(reps + 1)]
            for row in events:
                for (start, end), t, g in zip(row, tensors, gb.bucket_groups, strict=True):
                    start.record()
                    dist.all_reduce(t, op=op, group=g)
                    end.record()
            torch.cuda.synchronize(w.device)
            rows = [[s.elapsed_time(e) for s, e in row] for row in events[1:]]
        else:
            for r in range(reps + 1):
                row = []
                for t, g in zip(tensors, gb.bucket_groups, strict=True):
                    t0 = time.perf_counter()
                    dist.all_reduce(t, op=op, group=g)
                    row.append((time.perf_counter() - t0) * 1e3)
                if r:
                    rows.append(row)
    return later_start_ms(rows, w.device, gb.group)


def measure_graph(w: Workload, model, gb: GradBuckets, opt, reps: int) -> dict[str, Any]:
    g = capture_step(w, model, gb, opt)
    if isinstance(g, str):
        return {"graph_error": g}
    out: dict[str, Any] = {"graph": w.time(g.replay, 3, reps)}
    samples = []
    for _ in range(max(3, reps // 2)):
        with use(w.streams.compute):
            g.replay()
        m = gb.metrics()
        if m.get("timed"):
            samples.append(m)
    if samples:
        out["graph_metrics"] = median_metrics(samples, w.device, gb.group)
    torch.cuda.synchronize()
    del g
    return out


def measure_ddp(w: Workload, dtype: torch.dtype, warmup: int, reps: int, group: dist.ProcessGroup) -> Timing:
    dev = w.device
    with use(w.streams.compute):
        model = build_model(w.shape, dtype, dev)
        ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      bucket_cap_mb=w.shape.bucket_mb, gradient_as_bucket_view=True,
                                      process_group=group)
    opt = make_optimizer(ddp, dev)
    t = w.time(partial(step_ddp, w, ddp, opt), max(warmup, 5), reps)  # DDP rebuilds its buckets after step 1
    del ddp, model, opt
    free_memory(dev)
    return t


def measure_plain(w: Workload, nbytes: int, dtype: torch.dtype, reps: int, group: dist.ProcessGroup) -> float:
    """A lone all-reduce (AVG on NCCL, as the buckets) of `nbytes`, repeated on the all-reduce stream: ms, the
    minimum over ranks of each rank's median (the later rank's start, as for the buckets)."""
    stream = w.streams.allreduce
    itemsize = torch.empty((), dtype=dtype).element_size()
    with use(stream):
        buf = torch.ones(nbytes // itemsize, dtype=dtype, device=w.device)
    op = dist.ReduceOp.AVG if w.device.type == "cuda" else dist.ReduceOp.SUM
    with use(stream):
        fn = lambda: dist.all_reduce(buf, op=op, group=group)
        t = time_fn(fn, warmup=3, reps=reps, stream=stream, device=w.device)
    return over_ranks([t.median_ms], w.device, dist.ReduceOp.MIN)[0]


def busbw(nbytes: int, ms: float, n: int) -> float:
    return nbytes / (ms * 1e-3) / 1e9 * 2 * (n - 1) / n if ms > 0 else float("nan")


@dataclass
class _Sweep:
    """What one parameter dtype's sweep measured, shared by the records of its variants."""

    label: str  # "fp32" or "bf16"
    n: int  # ranks
    local_ms: float
    eager: dict[tuple[int, str], float]  # (cap, priority) -> peerline eager step, slowest rank
    ddp: dict[int, float]  # cap -> DDP step, slowest rank
    plain: dict[int, dict[int, float]]  # cap -> bucket bytes -> lone all-reduce ms
    bucket_bytes: list[int]
    sizes: dict[str, Any]

    @property
    def plain_total(self) -> float:
        """NCCL's default CTAs: what an un-overlapped gradient sync costs."""
        return sum(self.plain[0][b] for b in self.bucket_bytes)

    def ddp_exposed(self, cap: int) -> float:
        return max(0.0, self.ddp[cap] - self.local_ms)


def _measure_ours(ctx: BenchContext, w: Workload, dtype: torch.dtype, warmup: int, reps: int, graph: bool,
                  groups: dict[int, dist.ProcessGroup], variants: list[tuple[int, str]], tail_uncapped: bool
                  ) -> tuple[dict[tuple[int, str], dict[str, Any]], Timing, list[int], int]:
    """peerline's step on every (cap, priority): (results, the local step, bucket bytes, parameter count)."""
    dev, shape = w.device, w.shape
    with use(w.streams.compute):
        model = build_model(shape, dtype, dev)
    opt = make_optimizer(model, dev)
    layers = [list(b.parameters()) for b in model]
    ours: dict[tuple[int, str], dict[str, Any]] = {}
    local: Timing | None = None
    bucket_bytes: list[int] = []
    for cap, prio in variants:
        if ctx.on_step:
            ctx.on_step(f"allreduce peerline, {cap_name(cap)}, {prio} priority")
        # The normal-priority variant borrows the p2p role's stream (normal priority, unused in this suite): streams
        # come only from streams.py, and there the all-reduce role is the highest priority by design.
        stream = w.streams.allreduce if prio == "high" else w.streams.p2p
        # A capped group spares backward's GEMMs; the first block's buckets, whose all-reduce nothing is left to
        # overlap, run on NCCL's default CTAs (the tail group) unless --ar-no-tail-group.
        tail = groups[0] if cap and tail_uncapped else None
        gb = GradBuckets(layers, groups[cap], dev, stream, shape.bucket_mb, shape.first_bucket_mb, tail_group=tail)
        bucket_bytes = [b.nbytes for b in gb.buckets]
        if local is None:
            local = w.time(partial(step_peerline, w, model, gb, opt, sync=False), warmup, reps)
        ours[cap, prio] = measure_peerline(w, model, gb, opt, warmup, reps, graph)
        # The cap each bucket's all-reduce ran under (tail buckets: NCCL's default), for its plain anchor.
        ours[cap, prio]["bucket_caps"] = [cap if g is groups[cap] else 0 for g in gb.bucket_groups]
        ours[cap, prio]["tail_buckets"] = sum(g is not groups[cap] for g in gb.bucket_groups)
        gb.close()
        del gb
    params = sum(p.numel() for p in model.parameters())
    del model, opt, layers
    free_memory(dev)
    assert local is not None
    return ours, local, bucket_bytes, params


def _measure_anchors(ctx: BenchContext, w: Workload, dtype: torch.dtype, warmup: int, reps: int,
                     groups: dict[int, dist.ProcessGroup], bucket_bytes: list[int]
                     ) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """DDP's step (slowest rank) and a lone all-reduce of every bucket size, on every cap's group."""
    ddp: dict[int, float] = {}
    for cap in groups:
        if ctx.on_step:
            ctx.on_step(f"allreduce DDP, {cap_name(cap)}")
        ddp[cap] = max_over_ranks(measure_ddp(w, dtype, warmup, reps, groups[cap]).median_ms, w.device)
    sizes = sorted(set(bucket_bytes))
    plain = {cap: {nb: measure_plain(w, nb, dtype, reps, groups[cap]) for nb in sizes} for cap in groups}
    return ddp, plain


def run_dtype(ctx: BenchContext, shape: Shape, dtype: torch.dtype, warmup: int, reps: int, graph: bool,
              groups: dict[int, dist.ProcessGroup], headline: int | None, normal_priority: bool = False,
              tail_uncapped: bool = True) -> None:
    """Measure every variant on the group of every CTA cap (0 first: NCCL's default); record; `headline` None =
    the cap of the fastest peerline eager step. `normal_priority`: one more peerline variant, NCCL's default CTAs
    with the all-reduce on a normal-priority stream (as DDP's), to tell priority from CTA count (never headline)."""
    dev = ctx.device
    caps = list(groups)
    w = Workload(shape, dev)
    variants = [(cap, "high") for cap in caps] + ([(0, "normal")] if normal_priority else [])
    ours, local, bucket_bytes, params = _measure_ours(ctx, w, dtype, warmup, reps, graph, groups, variants,
                                                      tail_uncapped)
    ddp, plain = _measure_anchors(ctx, w, dtype, warmup, reps, groups, bucket_bytes)
    local_ms = max_over_ranks(local.median_ms, dev)
    eager = {v: max_over_ranks(ours[v]["eager"].median_ms, dev) for v in variants}
    if headline is None:
        headline = min(caps, key=lambda c: eager[c, "high"])
    n = dist.get_world_size()
    sizes = {"hidden": shape.hidden, "blocks": shape.blocks, "tokens": shape.micro_batch * shape.seq,
             "microbatches": shape.microbatches, "params": params, "grad_bytes": sum(bucket_bytes),
             "buckets": len(bucket_bytes), "bucket_mb": shape.bucket_mb, "dp": n}
    sweep = _Sweep("fp32" if dtype == torch.float32 else "bf16", n, local_ms, eager, ddp, plain, bucket_bytes,
                   sizes)
    for cap, prio in variants:
        _record_variant(ctx, sweep, cap, prio, ours[cap, prio], head=cap == headline and prio == "high")
    del w
    free_memory(dev)


def _record_variant(ctx: BenchContext, sw: _Sweep, cap: int, prio: str, res: dict[str, Any], head: bool) -> None:
    """The step, exposure and hidden-share records of one (cap, priority); the bucket records for the headline."""
    label = f"{sw.label} params, {cap_name(cap)}" + ("" if prio == "high" else ", normal-priority stream")
    sizes_c = {**sw.sizes, "nccl_max_ctas": cap, "allreduce_stream_priority": prio,
               "tail_buckets_default_ctas": res["tail_buckets"]}
    plain_total, ddp = sw.plain_total, sw.ddp
    base = {"local_ms": sw.local_ms, "plain_allreduce_total_ms": plain_total, "headline": head,
            "compute_to_allreduce": sw.local_ms / plain_total if plain_total > 0 else float("nan"),
            "ddp_same_cap_ms": ddp[cap], "ddp_default_ms": ddp[0], "bucket_bytes": sw.bucket_bytes}
    ctx.record(Record(SUITE, f"{label}: step (eager)", "ms/iter", sw.eager[cap, prio], ddp[0], "torch DDP eager, "
                      "nccl default CTAs", higher_is_better=False, sizes=sizes_c, extra=base))
    if "graph" in res:
        ctx.record(Record(SUITE, f"{label}: step (graph)", "ms/iter", max_over_ranks(res["graph"].median_ms,
                                                                                      ctx.device),
                          ddp[0], "torch DDP eager, nccl default CTAs", higher_is_better=False, sizes=sizes_c,
                          extra=base))
    elif "graph_error" in res:
        base = {**base, "graph_error": res["graph_error"]}
    _record_exposure(ctx, sw, cap, prio, res, label, sizes_c, base)
    if head:
        _record_buckets(ctx, sw, cap, res, label, sizes_c)


def _record_exposure(ctx: BenchContext, sw: _Sweep, cap: int, prio: str, res: dict[str, Any], label: str,
                     sizes_c: dict[str, Any], base: dict[str, Any]) -> None:
    """Exposed all-reduce and hidden share of one variant, against DDP's."""
    met, n = res["metrics"], sw.n
    exposed_extra = {**base, "step_minus_local_ms": max(0.0, sw.eager[cap, prio] - sw.local_ms), "goal_ms": 0.25,
                     "launched_in_backward": res["launched_in_backward"],
                     "ddp_same_cap_exposed_ms": sw.ddp_exposed(cap)}
    if "graph_metrics" in res:
        exposed_extra["graph_exposed_ms"] = res["graph_metrics"]["exposed_ms"]
        exposed_extra["graph_hidden_share"] = res["graph_metrics"]["hidden_share"]
    ctx.record(Record(SUITE, f"{label}: exposed all-reduce", "ms", met["exposed_ms"], sw.ddp_exposed(0),
                      "torch DDP (step - local step), nccl default CTAs", higher_is_better=False, sizes=sizes_c,
                      extra=exposed_extra))
    plain_total = sw.plain_total
    ddp_hidden = 1.0 - min(1.0, sw.ddp_exposed(0) / plain_total) if plain_total > 0 else float("nan")
    big = max(sw.bucket_bytes)
    on_cap = [t for b, c, t in zip(sw.bucket_bytes, res["bucket_caps"], res["alone_ms"], strict=True)
              if b == big and c == cap]
    alone_big = statistics.median(on_cap or [t for b, t in zip(sw.bucket_bytes, res["alone_ms"], strict=True)
                                             if b == big])
    ctx.record(Record(SUITE, f"{label}: hidden share", "fraction", met["hidden_share"], ddp_hidden,
                      "torch DDP (1 - exposed / plain all-reduce total)", sizes=sizes_c,
                      extra={**base, "allreduce_ms": met["allreduce_ms"], "goal": 0.9, "largest_bucket": big,
                             "alone_busbw_gbs": busbw(big, alone_big, n),
                             "plain_busbw_gbs": busbw(big, sw.plain[cap][big], n),
                             "plain_default_busbw_gbs": busbw(big, sw.plain[0][big], n)}))


def _record_buckets(ctx: BenchContext, sw: _Sweep, cap: int, res: dict[str, Any], label: str,
                    sizes_c: dict[str, Any]) -> None:
    """Bus bandwidth per bucket size and cap, alone after backward and inside the step, against a plain all-reduce."""
    met, n, plain, bucket_bytes = res["metrics"], sw.n, sw.plain, sw.bucket_bytes
    in_step = met.get("bucket_ms_later_start")
    for nbytes, bcap in sorted(set(zip(bucket_bytes, res["bucket_caps"], strict=True))):
        idx = [i for i, (b, c) in enumerate(zip(bucket_bytes, res["bucket_caps"], strict=True))
               if b == nbytes and c == bcap]
        alone = statistics.median(res["alone_ms"][i] for i in idx)
        extra: dict[str, Any] = {"count": len(idx), "alone_ms": alone, "plain_ms": plain[bcap][nbytes],
                                 "plain_default_ctas_busbw_gbs": busbw(nbytes, plain[0][nbytes], n),
                                 "alone_is": "bucket buffers all-reduced back to back after backward, same "
                                             "sequence, from the later rank's start"}
        if in_step is not None:
            ms = statistics.median(in_step[i] for i in idx)
            ms_rank = statistics.median(met["bucket_ms"][i] for i in idx)
            extra.update(in_step_ms=ms, in_step_busbw_gbs=busbw(nbytes, ms, n),
                         in_step_rank0_ms=ms_rank, in_step_rank0_busbw_gbs=busbw(nbytes, ms_rank, n),
                         in_step_is="inside the overlapped backward (shares the GPU), from the later rank's "
                                    "start; rank0: this rank's start, skew included")
        where = "" if bcap == cap else " (tail bucket, nccl default CTAs)"
        ctx.record(Record(SUITE, f"{label}: bucket {nbytes / MiB:.2f} MiB{where} busbw, alone after backward",
                          "GB/s", busbw(nbytes, alone, n), busbw(nbytes, plain[bcap][nbytes], n),
                          "plain all-reduce, same size and CTAs", sizes={**sizes_c, "bytes": nbytes,
                                                                         "bucket_nccl_max_ctas": bcap},
                          extra=extra))


def goals(ctx: BenchContext) -> list[str]:
    """GOAL lines for the headline cap's records, one SWEEP line per (dtype, cap)."""
    lines, sweep = [], []
    for r in ctx.records:
        head = r.extra.get("headline", True)
        if r.case.endswith("hidden share"):
            e = r.extra
            graph = next((q for q in ctx.records if q.case == r.case.replace("hidden share", "step (graph)")), None)
            expo = next((q for q in ctx.records if q.case == r.case.replace("hidden share", "exposed all-reduce")),
                        None)
            eager = next((q for q in ctx.records if q.case == r.case.replace("hidden share", "step (eager)")), None)
            if eager is not None and expo is not None:
                sweep.append(
                    f"SWEEP {SUITE} {r.case.rsplit(':', 1)[0]}: step eager {eager.peerline:.2f}"
                    + (f" / graph {graph.peerline:.2f}" if graph else "")
                    + f" ms, DDP {e['ddp_default_ms']:.2f} (default CTAs) / {e['ddp_same_cap_ms']:.2f} (same cap), "
                    f"local {e['local_ms']:.2f}; exposed {expo.peerline:.3f} ms, hidden {r.peerline:.3f}; "
                    f"{e['largest_bucket'] / MiB:.1f} MiB busbw alone {e['alone_busbw_gbs']:.0f}, plain "
                    f"{e['plain_busbw_gbs']:.0f} (default CTAs {e['plain_default_busbw_gbs']:.0f}) GB/s"
                    + (" [headline]" if head else ""))
        if not head:
            continue
        if r.case.endswith("hidden share"):
            lines.append(f"GOAL {'MET' if r.peerline >= 0.9 else 'MISSED'} {SUITE} {r.case}: {r.peerline:.3f} "
                         f"(>= 0.9), DDP {r.anchor:.3f}")
        elif r.case.endswith("exposed all-reduce"):
            lines.append(f"GOAL {'MET' if r.peerline <= 0.25 else 'MISSED'} {SUITE} {r.case}: {r.peerline:.3f} ms "
                         f"(<= 0.25), DDP {r.anchor:.3f} ms")
        elif "busbw, alone" in r.case and r.sizes.get("bytes", 0) >= MiB:  # smaller ones are latency-bound
            frac = r.peerline / r.anchor if r.anchor else float("nan")
            inside = r.extra.get("in_step_busbw_gbs")
            lines.append(f"GOAL {'MET' if frac >= 0.9 else 'MISSED'} {SUITE} {r.case}: {frac:.2f} of plain (>= 0.9)"
                         f", {r.peerline:.0f} vs {r.anchor:.0f} GB/s"
                         + (f"; inside backward {inside:.0f} GB/s (info)" if inside is not None else ""))
        elif "step (" in r.case:
            same = r.extra.get("ddp_same_cap_ms", r.anchor)
            best = min(r.anchor, same)  # fair: DDP could use the cap too
            lines.append(f"GOAL {'MET' if r.peerline <= best else 'MISSED'} {SUITE} {r.case}: "
                         f"{r.peerline:.2f} ms vs DDP {r.anchor:.2f} ms (default CTAs), {same:.2f} ms (same cap)")
    return lines + sweep


def parse_caps(text: str, flag: str = "--ar-nccl-ctas-sweep") -> list[int]:
    """'0,16,8,4' -> [0, 16, 8, 4] (0: NCCL's default); NCCL's default is always measured (the DDP anchor)."""
    try:
        caps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"allreduce bench: error: {flag} wants integers, got {text!r}") from None
    if any(c < 0 or c > 64 for c in caps):
        raise SystemExit(f"allreduce bench: error: CTA caps must be 0 (default) or 1..64, got {text!r}")
    return [0] + [c for c in dict.fromkeys(caps) if c != 0]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """This suite's flags (prefixed, so they sit next to other suites' in launch/bench.py)."""
    group.add_argument("--ar-hidden", dest="ar_hidden", type=int, default=None, help="block width (default 2048)")
    group.add_argument("--ar-blocks", dest="ar_blocks", type=int, default=None, help="MLP blocks (default 8)")
    group.add_argument("--ar-micro-batch-size", dest="ar_micro_batch", type=int, default=None,
                       help="sequences per microbatch (default 8)")
    group.add_argument("--ar-seq", dest="ar_seq", type=int, default=None, help="tokens per sequence (default 1024)")
    group.add_argument("--ar-microbatches", dest="ar_microbatches", type=int, default=None,
                       help="gradient accumulation steps (default 1)")
    group.add_argument("--ar-bucket-mb", dest="ar_bucket_mb", type=float, default=None,
                       help="bucket size, MiB, for peerline and DDP (default 25)")
    group.add_argument("--ar-first-bucket-mb", dest="ar_first_bucket_mb", type=float, default=None,
                       help="peerline's first bucket, MiB (default 1; DDP's is its own 1 MiB)")
    group.add_argument("--ar-param-dtype", dest="ar_param_dtype", choices=("fp32", "bf16", "both"), default=None,
                       help="parameter (and gradient) dtype (default both)")
    group.add_argument("--ar-no-graph", dest="ar_no_graph", action="store_true", help="skip the CUDA-graph variant")
    group.add_argument("--ar-nccl-ctas-sweep", dest="ar_ctas_sweep", default=None,
                       help="NCCL max CTA caps of the dp group to measure, comma-separated, 0 = NCCL's default "
                            "(default 0,16,8,4)")
    group.add_argument("--ar-normal-priority", dest="ar_normal_priority", action="store_true",
                       help="also measure peerline with its all-reduce on a normal-priority stream (NCCL's default "
                            "CTAs), in the sweep and in the head-to-head rounds: is it the priority or the CTA count "
                            "that slows backward?")
    group.add_argument("--ar-no-tail-group", dest="ar_no_tail_group", action="store_true",
                       help="capped variants: all-reduce the first block's buckets (exposed: nothing left to overlap) "
                            "on the capped group too, not on NCCL's default CTAs")
    group.add_argument("--ar-h2h-shapes", dest="ar_h2h_shapes", default=None,
                       help="head-to-head rounds (peerline eager / graph vs DDP, interleaved) on these shapes: "
                            "anchor (the suite's model), launch (16 blocks h=512, 4 microbatches), or none "
                            "(default anchor,launch)")
    group.add_argument("--ar-h2h-rounds", dest="ar_h2h_rounds", type=int, default=None,
                       help="interleaved rounds per head-to-head shape (default 12)")
    group.add_argument("--ar-h2h-steps", dest="ar_h2h_steps", type=int, default=None,
                       help="steps of each variant per round (default 3)")
    group.add_argument("--ar-h2h-caps", dest="ar_h2h_caps", default=None,
                       help="head-to-head: also peerline eager on dp groups with these NCCL CTA caps (comma list; "
                            "diagnostic variants, default none)")
    group.add_argument("--ar-h2h-only", dest="ar_h2h_only", action="store_true",
                       help="only the head-to-head rounds (skip the CTA sweep, busbw and exposure measurements)")
    group.add_argument("--ar-nccl-max-ctas", dest="ar_max_ctas", default=None,
                       help="the headline cap (GOAL lines): an integer (0 = NCCL's default) or auto = the sweep's "
                            "fastest peerline eager step (default: the runtime's --nccl-max-ctas default)")


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Suite entry point (needs an initialized process group of 2+ ranks: NCCL on CUDA, gloo on the CPU)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise SystemExit("allreduce bench: error: run with 2 ranks (torchrun --nproc_per_node=2)")
    quick = ctx.quick or ctx.device.type != "cuda"

    def opt(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    caps = parse_caps(opt("ar_ctas_sweep", "0,4" if quick else "0,16,8,4"))
    runtime_cap = 4 if quick else (RunConfig().nccl_max_ctas or 0)  # quick: a cap gloo ignores, same code path
    caps += [runtime_cap] if runtime_cap not in caps else []
    head_text = str(opt("ar_max_ctas", runtime_cap))
    if head_text == "auto":
        headline = None
    else:
        headline = parse_caps(head_text)[-1]
        caps = caps if headline in caps else [*caps, headline]
    if quick:
        shape = Shape(hidden=64, blocks=2, micro_batch=2, seq=16, microbatches=2, bucket_mb=0.02,
                      first_bucket_mb=0.005)
        dtypes, warmup, reps = [torch.float32], 1, 3
    else:
        shape = Shape(hidden=opt("ar_hidden", 2048), blocks=opt("ar_blocks", 8), micro_batch=opt("ar_micro_batch", 8),
                      seq=opt("ar_seq", 1024), microbatches=opt("ar_microbatches", 1),
                      bucket_mb=opt("ar_bucket_mb", 25.0), first_bucket_mb=opt("ar_first_bucket_mb", 1.0))
        dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16]}.get(opt("ar_param_dtype", "both"),
                                                                          [torch.float32, torch.bfloat16])
        warmup, reps = opt("warmup", 3), opt("reps", 20)
    h2h_caps = [c for c in parse_caps(str(opt("ar_h2h_caps", "")), "--ar-h2h-caps") if c]
    caps += [c for c in h2h_caps if c not in caps]
    groups = {cap: make_group(cap, ctx.device) for cap in caps}  # collective: every rank, same order
    if not getattr(args, "ar_h2h_only", False):
        for dtype in dtypes:
            run_dtype(ctx, shape, dtype, warmup, reps, not getattr(args, "ar_no_graph", False), groups, headline,
                      normal_priority=quick or bool(getattr(args, "ar_normal_priority", False)),
                      tail_uncapped=not getattr(args, "ar_no_tail_group", False))
    rounds = opt("ar_h2h_rounds", 2 if quick else 12)
    if rounds < 1 or opt("ar_h2h_steps", 1) < 1:
        raise SystemExit("allreduce bench: error: --ar-h2h-rounds and --ar-h2h-steps must be >= 1")
    h2h_dtype = torch.float32 if quick else torch.bfloat16  # bf16: the DDP anchor's setting
    for name, h2h_shape in h2h_shapes(str(opt("ar_h2h_shapes", "anchor,launch")), shape, quick).items():
        if ctx.on_step:
            ctx.on_step(f"allreduce head-to-head, {name}")
        run_head_to_head(ctx, name, h2h_shape, h2h_dtype, rounds, opt("ar_h2h_steps", 1 if quick else 3), groups,
                         runtime_cap, normal_priority=bool(getattr(args, "ar_normal_priority", False)),
                         extra_caps=tuple(h2h_caps))
    if ctx.is_writer:
        for line in goals(ctx) + h2h_goal_lines(ctx):
            log.info("%s", line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for allreduce.jsonl and .md (rank 0)")
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU (gloo): a smoke test")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per variant (default 20)")
    add_arguments(parser.add_argument_group("allreduce"))
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        print("allreduce bench: error: run under torchrun --nproc_per_node=2", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available() and not args.quick
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(message)s")
    timeout = datetime.timedelta(seconds=180)
    if on_gpu:
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    ctx = BenchContext(out_dir=args.out, device=device, is_writer=dist.get_rank() == 0, quick=args.quick,
                       autosave_stem=SUITE)
    run(args, ctx)
    paths = ctx.write(SUITE)
    if paths:
        log.info("wrote %s and %s", *paths)  # run() logged the GOAL and SWEEP lines
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
