"""allreduce suite: peerline's bucketed all-reduce (GradBuckets) overlapped with backward, next to torch DDP on the
same model, bucket size and optimizer, in the same run.

Run under torchrun with 2 ranks (`torchrun --nproc_per_node=2 launch/suites/allreduce.py --out DIR`). Model: a
stack of residual MLP blocks (LayerNorm -> Linear h->4h, no bias -> + bias, GELU -> Linear 4h->h -> residual),
8 blocks of h=2048 (268.6 M parameters), bf16 autocast, fused AdamW (capturable), MSE loss. Per parameter dtype
(fp32 params: 1 GiB of fp32 gradients, what the engine runs; bf16 params: 512 MiB, the DDP anchor's setting):

  local      one step without any gradient sync: the compute time the all-reduce has to hide behind
  peerline   GradBuckets (25 MiB buckets, 1 MiB first), all-reduce stream of the highest priority, eager
  graph      the same step captured whole in a CUDA graph and replayed
  DDP        DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=True), eager
  plain      a lone NCCL all-reduce of each bucket size, for bucket bus bandwidth

Reported: step time (max over ranks), exposed all-reduce (peerline: CUDA events from the end of the last
backward kernel to the optimizer's start; DDP: its step minus the local step), the share of the all-reduce hidden
behind backward, and bus bandwidth per bucket size inside the overlapped step against the plain all-reduce.
Goals (issue 5): >= 90% hidden, <= 0.25 ms exposed, bucket busbw >= 90% of plain, step no worse than DDP.
`--quick` (or ctx.quick): a tiny model on the CPU with gloo, as a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from peerline.distributed.buckets import GradBuckets, MiB
from peerline.distributed.streams import create_rank_streams, use
from peerline.launch.benchkit import BenchContext, Record, Timing, time_fn

log = logging.getLogger(__name__)
SUITE = "allreduce"


class Block(torch.nn.Module):
    """LayerNorm -> Linear h->4h (no bias) -> + bias, GELU -> Linear 4h->h -> residual."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(4 * h))
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)) + self.bias))


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int = 2048
    blocks: int = 8
    micro_batch: int = 8
    seq: int = 1024
    microbatches: int = 1
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device) -> torch.nn.Sequential:
    """The same weights on every rank (rank 0's, broadcast) and for every variant; initialized on the device."""
    torch.manual_seed(1234)
    with torch.device(device):
        model = torch.nn.Sequential(*[Block(shape.hidden) for _ in range(shape.blocks)]).to(dtype=dtype)
    for p in model.parameters():
        dist.broadcast(p.detach(), src=0)
    return model


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


class Workload:
    """Static inputs / targets of every microbatch and the compute stream every variant runs on."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        self.streams = create_rank_streams(device)
        g = torch.Generator(device=device).manual_seed(99 + dist.get_rank())
        dims = (shape.micro_batch, shape.seq, shape.hidden)
        with use(self.streams.compute):
            self.xs = [torch.randn(dims, device=device, generator=g) for _ in range(shape.microbatches)]
            self.ys = [torch.randn(dims, device=device, generator=g) for _ in range(shape.microbatches)]
        self.autocast_dtype = torch.bfloat16 if device.type == "cuda" else None

    def loss(self, model: torch.nn.Module, m: int) -> torch.Tensor:
        if self.autocast_dtype is None:
            out = model(self.xs[m])
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                out = model(self.xs[m].to(next(model.parameters()).dtype))
        return F.mse_loss(out.float(), self.ys[m]) / self.shape.microbatches

    def time(self, fn: Callable[[], Any], warmup: int, reps: int) -> Timing:
        with use(self.streams.compute):
            return time_fn(fn, warmup=warmup, reps=reps, stream=self.streams.compute, device=self.device)


def step_peerline(w: Workload, model: torch.nn.Module, gb: GradBuckets, opt: torch.optim.Optimizer,
                  sync: bool = True) -> None:
    """One training step; with sync=False the hooks stay unarmed: the local (no all-reduce) step."""
    gb.zero_grad()
    for m in range(w.shape.microbatches):
        if sync and m == w.shape.microbatches - 1:
            gb.arm()
        w.loss(model, m).backward()
    if sync:
        gb.finish()
    opt.step()


def step_ddp(w: Workload, ddp: DistributedDataParallel, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)  # the grads are views into DDP's buckets: keep them
    for m in range(w.shape.microbatches):
        if m < w.shape.microbatches - 1:
            with ddp.no_sync():
                w.loss(ddp, m).backward()
        else:
            w.loss(ddp, m).backward()
    opt.step()


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def median_metrics(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples)
                           for k in ("allreduce_ms", "exposed_ms", "hidden_share")}
    if samples[0].get("bucket_ms") is not None:
        out["bucket_ms"] = [statistics.median(s["bucket_ms"][i] for s in samples)
                            for i in range(len(samples[0]["bucket_ms"]))]
    return out


def measure_peerline(w: Workload, dtype: torch.dtype, warmup: int, reps: int, graph: bool) -> dict[str, Any]:
    dev = w.device
    with use(w.streams.compute):
        model = build_model(w.shape, dtype, dev)
    gb = GradBuckets([list(b.parameters()) for b in model], dist.group.WORLD, dev, w.streams.allreduce,
                     w.shape.bucket_mb, w.shape.first_bucket_mb)
    opt = make_optimizer(model, dev)
    res: dict[str, Any] = {"bucket_bytes": [b.nbytes for b in gb.buckets],
                           "params": sum(p.numel() for p in model.parameters())}
    res["local"] = w.time(lambda: step_peerline(w, model, gb, opt, sync=False), warmup, reps)
    res["eager"] = w.time(lambda: step_peerline(w, model, gb, opt), warmup, reps)
    samples = []
    for _ in range(max(3, reps // 2)):
        with use(w.streams.compute):
            step_peerline(w, model, gb, opt)
        samples.append(gb.metrics())
    res["metrics"] = median_metrics(samples)
    res["launched_in_backward"] = samples[-1]["launched_in_backward"]
    if graph and dev.type == "cuda":
        res.update(measure_graph(w, model, gb, opt, reps))
    gb.close()
    return res


def measure_graph(w: Workload, model, gb: GradBuckets, opt, reps: int) -> dict[str, Any]:
    compute = w.streams.compute
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=compute, capture_error_mode="thread_local"):
            step_peerline(w, model, gb, opt)
    except Exception as exc:  # noqa: BLE001 - a failed capture is a result, not a crash of the suite
        log.warning("graph capture failed: %s: %s", type(exc).__name__, exc)
        torch.cuda.synchronize()
        dist.barrier()
        return {"graph_error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"graph": w.time(g.replay, 3, reps)}
    samples = []
    for _ in range(max(3, reps // 2)):
        with use(compute):
            g.replay()
        m = gb.metrics()
        if m.get("timed"):
            samples.append(m)
    if samples:
        out["graph_metrics"] = median_metrics(samples)
    del g
    return out


def measure_ddp(w: Workload, dtype: torch.dtype, warmup: int, reps: int) -> Timing:
    dev = w.device
    with use(w.streams.compute):
        model = build_model(w.shape, dtype, dev)
        ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                      bucket_cap_mb=w.shape.bucket_mb, gradient_as_bucket_view=True)
    opt = make_optimizer(ddp, dev)
    return w.time(lambda: step_ddp(w, ddp, opt), max(warmup, 5), reps)  # DDP rebuilds its buckets after step 1


def measure_plain(w: Workload, nbytes: int, dtype: torch.dtype, reps: int) -> Timing:
    """A lone all-reduce (AVG on NCCL, as the buckets) of `nbytes` on the all-reduce stream."""
    stream = w.streams.allreduce
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.ones(nbytes // itemsize, dtype=dtype, device=w.device)
    op = dist.ReduceOp.AVG if w.device.type == "cuda" else dist.ReduceOp.SUM
    with use(stream):
        fn = lambda: dist.all_reduce(buf, op=op)
        return time_fn(fn, warmup=3, reps=reps, stream=stream, device=w.device)


def busbw(nbytes: int, ms: float, n: int) -> float:
    return nbytes / (ms * 1e-3) / 1e9 * 2 * (n - 1) / n if ms > 0 else float("nan")


def run_dtype(ctx: BenchContext, shape: Shape, dtype: torch.dtype, warmup: int, reps: int, graph: bool) -> None:
    dev = ctx.device
    w = Workload(shape, dev)
    ours = measure_peerline(w, dtype, warmup, reps, graph)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ddp = measure_ddp(w, dtype, warmup, reps)
    sizes = sorted(set(ours["bucket_bytes"]))
    plain = {n: measure_plain(w, n, dtype, reps) for n in sizes}
    n = dist.get_world_size()

    local_ms = max_over_ranks(ours["local"].median_ms, dev)
    eager_ms = max_over_ranks(ours["eager"].median_ms, dev)
    ddp_ms = max_over_ranks(ddp.median_ms, dev)
    plain_total = sum(plain[b].median_ms for b in ours["bucket_bytes"])
    met = ours["metrics"]
    ddp_exposed = max(0.0, ddp_ms - local_ms)
    label = f"{'fp32' if dtype == torch.float32 else 'bf16'} params"
    common = {"hidden": shape.hidden, "blocks": shape.blocks, "tokens": shape.micro_batch * shape.seq,
              "microbatches": shape.microbatches, "params": ours["params"], "grad_bytes": sum(ours["bucket_bytes"]),
              "buckets": len(ours["bucket_bytes"]), "bucket_mb": shape.bucket_mb, "dp": n}
    base_extra = {"local_ms": local_ms, "plain_allreduce_total_ms": plain_total,
                  "compute_to_allreduce": local_ms / plain_total if plain_total > 0 else float("nan")}
    ctx.record(Record(SUITE, f"{label}: step (eager)", "ms/iter", eager_ms, ddp_ms, "torch DDP eager",
                      higher_is_better=False, sizes=common, extra=base_extra))
    if "graph" in ours:
        ctx.record(Record(SUITE, f"{label}: step (graph)", "ms/iter", max_over_ranks(ours["graph"].median_ms, dev),
                          ddp_ms, "torch DDP eager", higher_is_better=False, sizes=common, extra=base_extra))
    elif "graph_error" in ours:
        base_extra = {**base_extra, "graph_error": ours["graph_error"]}
    exposed_extra = {**base_extra, "step_minus_local_ms": max(0.0, eager_ms - local_ms), "goal_ms": 0.25,
                     "launched_in_backward": ours["launched_in_backward"]}
    if "graph_metrics" in ours:
        exposed_extra["graph_exposed_ms"] = ours["graph_metrics"]["exposed_ms"]
        exposed_extra["graph_hidden_share"] = ours["graph_metrics"]["hidden_share"]
    ctx.record(Record(SUITE, f"{label}: exposed all-reduce", "ms", met["exposed_ms"], ddp_exposed,
                      "torch DDP (step - local step)", higher_is_better=False, sizes=common, extra=exposed_extra))
    ddp_hidden = 1.0 - min(1.0, ddp_exposed / plain_total) if plain_total > 0 else float("nan")
    ctx.record(Record(SUITE, f"{label}: hidden share", "fraction", met["hidden_share"], ddp_hidden,
                      "torch DDP (1 - exposed / plain all-reduce total)", sizes=common,
                      extra={**base_extra, "allreduce_ms": met["allreduce_ms"], "goal": 0.9}))
    if met.get("bucket_ms") is not None:
        for nbytes in sizes:
            ms = [t for b, t in zip(ours["bucket_bytes"], met["bucket_ms"], strict=True) if b == nbytes]
            ctx.record(Record(SUITE, f"{label}: bucket {nbytes / MiB:.2f} MiB busbw", "GB/s",
                              busbw(nbytes, statistics.median(ms), n), busbw(nbytes, plain[nbytes].median_ms, n),
                              "plain all-reduce, same size", sizes={**common, "bytes": nbytes},
                              extra={"count": len(ms), "in_step_ms": statistics.median(ms),
                                     "plain_ms": plain[nbytes].median_ms}))
    del w
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def goals(ctx: BenchContext) -> list[str]:
    lines = []
    for r in ctx.records:
        if r.case.endswith("hidden share"):
            lines.append(f"GOAL {'MET' if r.peerline >= 0.9 else 'MISSED'} {SUITE} {r.case}: {r.peerline:.3f} "
                         f"(>= 0.9), DDP {r.anchor:.3f}")
        elif r.case.endswith("exposed all-reduce"):
            lines.append(f"GOAL {'MET' if r.peerline <= 0.25 else 'MISSED'} {SUITE} {r.case}: {r.peerline:.3f} ms "
                         f"(<= 0.25), DDP {r.anchor:.3f} ms")
        elif r.case.endswith("busbw") and r.sizes.get("bytes", 0) >= MiB:  # smaller ones are latency-bound
            frac = r.peerline / r.anchor if r.anchor else float("nan")
            lines.append(f"GOAL {'MET' if frac >= 0.9 else 'MISSED'} {SUITE} {r.case}: {frac:.2f} of plain (>= 0.9)")
        elif "step (" in r.case:
            lines.append(f"GOAL {'MET' if r.peerline <= r.anchor else 'MISSED'} {SUITE} {r.case}: "
                         f"{r.peerline:.2f} ms vs DDP {r.anchor:.2f} ms")
    return lines


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


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Suite entry point (needs an initialized process group of 2+ ranks: NCCL on CUDA, gloo on the CPU)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise SystemExit("allreduce bench: error: run with 2 ranks (torchrun --nproc_per_node=2)")
    quick = ctx.quick or ctx.device.type != "cuda"

    def opt(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

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
    for dtype in dtypes:
        run_dtype(ctx, shape, dtype, warmup, reps, graph=not getattr(args, "ar_no_graph", False))
    if ctx.is_writer:
        for line in goals(ctx):
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
    ctx = BenchContext(out_dir=args.out, device=device, is_writer=dist.get_rank() == 0, quick=args.quick)
    run(args, ctx)
    paths = ctx.write(SUITE)
    if paths:
        log.info("wrote %s and %s", *paths)
        for line in goals(ctx):
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
