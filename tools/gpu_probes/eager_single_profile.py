"""Where a one-GPU eager iteration of the residual MLP spends its time: plain torch eager (the eager suite's
PlainTorch) against peerline --stages 1 --no-graph with the same recipe, under torch.profiler.

Per side: wall ms per iteration (unprofiled: both sides resident, their blocks of iterations alternating, before any
profiler session), the GPU's busy time per iteration (the union of kernel and copy intervals) and how much of the
wall it covers, device time by class and the top kernels, and the host ops (aten ops and Python functions) by self
CPU time. Then both sides' totals side by side. One GPU; `--device cpu` checks that it runs (no kernel rows). INFO
lines only.

    PYTHONPATH=$PWD python3 tools/gpu_probes/eager_single_profile.py [--config mid] [--recipe bf16] [--iters 2]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from top_kernels import busy_ms, device_times, host_self_times
from torch.profiler import ProfilerActivity, profile

from peerline.bench.benchkit import time_blocks_interleaved
from peerline.bench.runtime_timing import open_runtime
from peerline.bench.suites.eager import SINGLE_RECIPES, PlainTorch
from peerline.bench.suites.pipeline import CONFIGS
from peerline.bench.suites.torch_pipelining import PipeShape
from peerline.distributed.config import RunConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="mid", choices=sorted(CONFIGS), help="the pipeline suite's shape (default mid)")
    p.add_argument("--recipe", default="bf16", choices=sorted(SINGLE_RECIPES), help="precision recipe (default bf16)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the shape's)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches (default: the shape's)")
    p.add_argument("--iters", type=int, default=2, help="profiled iterations per side (default 2)")
    p.add_argument("--timed", type=int, default=10,
                   help="iterations per unprofiled block: 3 blocks per side, alternating, after a warm-up block "
                        "(default 10)")
    p.add_argument("--top", type=int, default=20, help="rows per list (default 20)")
    p.add_argument("--with-stack", action=argparse.BooleanOptionalAction, default=True,
                   help="record Python functions in the profile (default on)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--trace-dir", default=None, help="also keep each side's chrome trace there (<side>.json.gz)")
    return p.parse_args(argv)


def _merge_names(counter: collections.Counter) -> collections.Counter:
    """Host rows by name with object addresses left out ("... at 0x7f...")."""
    out: collections.Counter = collections.Counter()
    for key, value in counter.items():
        out[re.sub(r" at 0x[0-9a-f]+", "", key)] += value
    return out


def _thread_wait(name: str) -> bool:
    """A threading.py frame: a thread waiting (the watchdog's), left out of the host time with
    the lock acquires nested in it."""
    return "threading.py" in name


def profile_side(name: str, run: Callable[[int], None], device: torch.device, a: argparse.Namespace,
                 wall: float) -> dict[str, Any]:
    """Profile `a.iters` iterations of `run` (one call runs n iterations) and print the side's rows; `wall` is its
    unprofiled time per iteration, measured before any profiler session of the process (a side timed after another
    side's session ran 39 % slower than the eager suite measures it, likely from the profiler's hooks left
    loaded)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=a.with_stack) as prof:
        run(a.iters)
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            text = trace.read()
    if a.trace_dir:
        os.makedirs(a.trace_dir, exist_ok=True)
        with gzip.open(os.path.join(a.trace_dir, f"{name}.json.gz"), "wt") as out:
            out.write(text)
    events = json.loads(text)["traceEvents"]
    per_it = a.iters * 1000.0
    busy = busy_ms(events) / a.iters
    by_kernel, count, classes = device_times(events)
    self_us, calls = host_self_times(events, _thread_wait)
    self_us, calls = _merge_names(self_us), _merge_names(calls)
    host_total = sum(self_us.values()) / per_it
    print(f"INFO {name}: wall {wall:.2f} ms/iter unprofiled; GPU busy {busy:.2f} ms/iter "
          f"({busy / wall * 100 if wall else 0:.0f}% of the wall); host self {host_total:.2f} ms/iter profiled over "
          f"{sum(calls.values()) / a.iters:.0f} host events")
    print(f"INFO {name}: device by class " + ", ".join(f"{k} {v / per_it:.2f}" for k, v in classes.most_common()))
    for key, us in by_kernel.most_common(a.top):
        print(f"INFO {name} kernel {us / per_it:8.3f} ms  x{count[key] / a.iters:6.0f}  {key[:140]}")
    for key, us in self_us.most_common(a.top):
        print(f"INFO {name} host {us / per_it:8.3f} ms  x{calls[key] / a.iters:6.0f}  {key[:140]}")
    return {"wall": wall, "busy": busy, "host": host_total, "kernels": sum(count.values()) / a.iters,
            "host_calls": {k: v / a.iters for k, v in calls.items()}}


def one_gpu_cell(a: argparse.Namespace) -> tuple[torch.device, PipeShape, PlainTorch, RunConfig]:
    """The eager suite's one-GPU cell of `a.config` (with `a.layers` / `a.microbatches` where set) and `a.recipe`
    on `a.device`: the device (made current), the shape, plain torch's side and peerline's RunConfig (--stages 1
    --no-graph, the loss read once per block)."""
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = CONFIGS[a.config]
    layers, microbatches = getattr(a, "layers", None), getattr(a, "microbatches", None)
    if layers or microbatches:
        shape = replace(shape, layers=layers or shape.layers, microbatches=microbatches or shape.microbatches)
    param_dtype, precision = SINGLE_RECIPES[a.recipe]
    if device.type != "cuda":
        param_dtype, precision = None, "autocast"  # bf16 parameters need bf16 compute
    cfg = RunConfig(schedule="1f1b", microbatches=shape.microbatches, micro_batch_size=shape.micro_batch_size,
                    seq=shape.seq, hidden=shape.hidden, layers=shape.layers, seed=shape.seed, lr=shape.lr,
                    dtype=shape.dtype, device=device.type, graph=False, iters=10**9, log_every=10**9, stages=1,
                    precision=precision)
    return device, shape, PlainTorch(shape, device, param_dtype), cfg


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device, shape, plain, cfg = one_gpu_cell(a)
    print(f"INFO shape {shape.name}: {shape.layers} blocks h={shape.hidden}, micro-batch {shape.micro_batch_size}x"
          f"{shape.seq}, M={shape.microbatches}; recipe {a.recipe}; {device}")
    with open_runtime(cfg) as rt:
        sides = {"torch": lambda n: [plain.step() for _ in range(n)], "peerline": lambda n: rt.train(rt.iteration + n)}
        # Both resident, timed in alternating blocks (A B, B A, ...) before either is profiled: a host that drifts
        # falls on both, and no profiler session has run yet.
        walls = time_blocks_interleaved(list(sides.values()), iters=a.timed, reps=3, warmup=1, device=device)
        got = {name: profile_side(name, run, device, a, wall.median_ms)
               for (name, run), wall in zip(sides.items(), walls)}
    t, p = got["torch"], got["peerline"]
    print(f"INFO side by side (torch / peerline): wall {t['wall']:.2f} / {p['wall']:.2f} ms (ratio "
          f"{t['wall'] / p['wall']:.3f}); GPU busy {t['busy']:.2f} / {p['busy']:.2f}; host self {t['host']:.2f} / "
          f"{p['host']:.2f}; device ops {t['kernels']:.0f} / {p['kernels']:.0f} per iteration")
    names = set(t["host_calls"]) | set(p["host_calls"])
    diff = sorted(names, key=lambda k: -abs(p["host_calls"].get(k, 0) - t["host_calls"].get(k, 0)))
    for key in diff[:a.top]:
        print(f"INFO calls per iteration torch {t['host_calls'].get(key, 0):7.0f}  peerline "
              f"{p['host_calls'].get(key, 0):7.0f}  {key[:120]}")


if __name__ == "__main__":
    main()
