"""Where a captured pipeline iteration's time goes on each rank: peerline with graphs at pp = world size, or one GPU
running the whole model (pp=1), under torch.profiler.

Per rank: wall ms per iteration (unprofiled: blocks of replays, synced at the end of a block), the GPU's busy time
per iteration (the union of kernel and copy intervals) and the idle rest, device time by class and the top kernels,
and the longest intervals in which no stream runs anything, with the work on either side. Run once at pp=2 and
once on one GPU (pp=1, every layer in one stage): the one-GPU time divided by pp is the bubble-free time of the
schedules issue, and the two runs' kernel totals show whether the pipeline's extra time is idle (waits) or device
time (slower or more kernels). INFO lines only.

    torchrun --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py [--config compute] [--schedule zbv]
        [--precision bf16] [--iters 2] [--timed 10]
    python3 tools/gpu_probes/pipeline_profile.py --schedule 1f1b        # one GPU, the whole model in one stage
    torchrun --nproc_per_node=2 tools/gpu_probes/pipeline_profile.py --gpt 8x4096 --heads 32 --seq 4096
        --micro-batch-size 1 --microbatches 8     # the GPT (--model gpt on the default text corpus) instead
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from top_kernels import busy_ms, device_events, device_times, idle_intervals, kernel_class
from torch.profiler import ProfilerActivity, profile

from peerline.bench.ideal import stages_per_rank
from peerline.bench.runtime_timing import first_losses, open_runtime
from peerline.bench.suites.gpt_anchor import GPTShape
from peerline.bench.suites.pipeline import CONFIGS
from peerline.distributed.config import RunConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="compute", choices=sorted(CONFIGS), help="the pipeline suite's shape")
    p.add_argument("--schedule", default="zbv", help="peerline's --schedule (default zbv; 1f1b on one GPU)")
    p.add_argument("--precision", default="bf16", help="peerline's --precision (default bf16)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches (default: the shape's)")
    p.add_argument("--iters", type=int, default=2, help="profiled iterations (default 2)")
    p.add_argument("--timed", type=int, default=10, help="unprofiled iterations timed (default 10)")
    p.add_argument("--top", type=int, default=15, help="rows per list (default 15)")
    p.add_argument("--gpt", default=None, metavar="LAYERSxHIDDEN",
                   help="profile the GPT of this shape instead of the MLP suite's --config (e.g. 8x4096)")
    p.add_argument("--heads", type=int, default=32, help="the GPT's attention heads (default 32)")
    p.add_argument("--seq", type=int, default=4096, help="the GPT's sequence length (default 4096)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="the GPT's micro-batch size (default 1)")
    p.add_argument("--trace-dir", default=None, help="also keep each rank's chrome trace there (rank<R>.json.gz)")
    return p.parse_args(argv)


def idle_gaps(events: list[dict], top: int) -> list[tuple[float, float, str, str]]:
    """The `top` longest intervals in which no stream of the device runs anything (top_kernels.idle_intervals), as
    (us, offset from the window's start in us, the work that ended last before it, the work that starts it). A gap
    on one stream alone is not idle time: a rank with two stages runs each on its own stream."""
    if not events:
        return []
    t0 = min(e["ts"] for e in events)
    gaps = [(stop - start, start - t0, before["name"][:60], after["name"][:60])
            for start, stop, before, after in idle_intervals(events)]
    return sorted(gaps, reverse=True)[:top]


def host_waits(events: list[dict], top: int) -> list[tuple[float, int, str]]:
    """The host calls that copy or wait (cudaMemcpy*, *Synchronize, cudaStreamWaitEvent left out: it does not block
    the host), each with the chain of host ops and Python functions around it (innermost last), grouped: (total
    us, calls, chain), the longest first."""
    kinds = ("cpu_op", "python_function", "user_annotation")
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in kinds]
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
             and ("Memcpy" in e["name"] or "Synchronize" in e["name"])]
    by_tid: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in host:
        by_tid[e.get("tid")].append(e)
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for c in calls:
        start, stop = c["ts"], c["ts"] + c.get("dur", 0)
        around = sorted((e for e in by_tid.get(c.get("tid"), ())
                         if e["ts"] <= start and e["ts"] + e.get("dur", 0) >= stop), key=lambda e: e["ts"])
        chain = " > ".join(e["name"][:50] for e in around[-7:])
        groups[f"{c['name']} in {chain}"].append(c.get("dur", 0))
    rows = sorted(((sum(v), len(v), k) for k, v in groups.items()), reverse=True)
    return rows[:top]


def report(rank: int, events: list[dict], iters: int, wall_ms: float, top: int) -> dict[str, Any]:
    """INFO lines for one rank's profiled window; the figures per iteration."""
    dev = device_events(events)
    window = (max(e["ts"] + e.get("dur", 0) for e in dev) - min(e["ts"] for e in dev)) / 1e3 / iters if dev else 0.0
    busy = busy_ms(events) / iters
    by_name, counts, by_class = device_times(events)
    streams = collections.Counter(e.get("tid", 0) for e in dev)
    print(f"INFO rank {rank}: wall {wall_ms:.2f} ms/iter unprofiled; profiled device window {window:.2f} ms/iter, "
          f"GPU busy {busy:.2f} ms ({100 * busy / window if window else 0:.1f} %), idle {window - busy:.2f} ms; "
          f"device time {sum(by_class.values()) / 1e3 / iters:.2f} ms over {len(streams)} streams", flush=True)
    for cls, us in by_class.most_common():
        print(f"INFO rank {rank}: class {cls}: {us / 1e3 / iters:.2f} ms/iter", flush=True)
    for name, us in by_name.most_common(top):
        print(f"INFO rank {rank}: kernel {us / 1e3 / iters:8.3f} ms/iter  x{counts[name] // iters:<5d} "
              f"[{kernel_class(name)}] {name[:110]}", flush=True)
    gaps = idle_gaps(dev, top)
    idle = sum(g for g, _, _, _ in gaps) / 1e3 / iters
    print(f"INFO rank {rank}: the {len(gaps)} longest idle intervals (no stream busy): {idle:.2f} ms/iter",
          flush=True)
    for us, at, before, after in gaps:
        print(f"INFO rank {rank}: idle {us / 1e3:.3f} ms at {at / 1e3:.2f} ms after {before} | before {after}",
              flush=True)
    for us, n, chain in host_waits(events, top):
        print(f"INFO rank {rank}: host copy/wait {us / 1e3 / iters:.3f} ms/iter x{n / iters:g}: {chain[:400]}",
              flush=True)
    return {"wall_ms": wall_ms, "window_ms": window, "busy_ms": busy,
            "by_class_ms": {k: v / 1e3 / iters for k, v in by_class.items()}}


def load_trace(prof: Any, rank: int, trace_dir: str | None) -> list[dict]:
    """The profile's chrome trace events (kept under trace_dir as rank<R>.json.gz when given)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with gzip.open(os.path.join(trace_dir, f"rank{rank}.json.gz"), "wt") as f:
            json.dump(trace, f)
    return trace.get("traceEvents", [])


def run_config(a: argparse.Namespace, world: int) -> RunConfig:
    """The profiled run: the MLP suite's --config, or the GPT of --gpt's shape."""
    common = {"schedule": a.schedule, "precision": a.precision, "graph": True, "iters": 10**9, "log_every": 10**9}
    if a.gpt:
        layers, hidden = (int(v) for v in a.gpt.lower().split("x"))
        shape = GPTShape("profiled", layers, hidden, a.heads, a.seq, a.micro_batch_size, a.microbatches or 8, "bf16")
        return shape.run_config(None, stages=stages_per_rank(a.schedule, world, layers), **common)
    s = CONFIGS[a.config]
    return RunConfig(stages=stages_per_rank(a.schedule, world, s.layers), microbatches=a.microbatches or s.microbatches,
                     micro_batch_size=s.micro_batch_size, seq=s.seq, hidden=s.hidden, layers=s.layers, seed=s.seed,
                     lr=s.lr, dtype=s.dtype, **common)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = run_config(a, world)
    stages = cfg.stages
    with open_runtime(cfg) as rt:
        rank = dist.get_rank() if dist.is_initialized() else 0
        _, not_captured = first_losses(rt, 2, graph=True)
        if not_captured:
            raise SystemExit(f"pipeline_profile: the iteration was not captured: {not_captured}")
        rt.train(rt.iteration + 3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.train(rt.iteration + a.timed)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / a.timed
        if dist.is_initialized():
            dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            rt.train(rt.iteration + a.iters)
            torch.cuda.synchronize()
        what = f"GPT {a.gpt}" if a.gpt else a.config
        print(f"INFO rank {rank}: {what} pp={world} {a.schedule} (stages per rank {stages}) --precision "
              f"{a.precision}, M={cfg.microbatches}", flush=True)
        report(rank, load_trace(prof, rank, a.trace_dir), a.iters, wall, a.top)


if __name__ == "__main__":
    main()
