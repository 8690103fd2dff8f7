"""Benchmark suite `single`: single-GPU mode, (a) three-way overlap and (b) the allocator under variable sizes.

    python -m peerline.bench.suites.single [--out DIR] [--quick]        (also: launch/bench.py single)

(a) Copy-heavy configuration (small hidden size, long sequences: host<->device copies are a large share): the
    overlapped pipeline (PinnedStagingFeed: H2D on the h2d stream, compute on the stage streams, D2H of the last
    stage's outputs on the d2h stream) against a serial version (the same feed with every copy on the compute
    stream, synchronous) and against the bound max(H2D, compute, D2H) per iteration, each term measured alone in
    the same run. The layer count is calibrated at start so that compute is about the H2D time (the case where
    overlap matters most; on another card the same sizes would be compute- or copy-bound). Goals: >= 85% of the
    bound, >= 2x the serial version. Host data generation is kept out (refill=False: each pinned slot is filled
    once), since no single CPU thread writes memory at PCIe speed; a real loader writes into the pinned slots
    from other cores.
(b) The allocator, eager (a replayed graph allocates nothing): per-iteration time (host sync after each
    iteration, so allocation costs show) and its spread,
    with variable-size scratch per microbatch (ScratchJitter), under `caching`, `async` (pool keeps all) and
    `async` with release threshold 0; device allocations counted (cudaMalloc calls, or pool growths for async).
    The backend must be chosen before torch loads, so each variant runs in a fresh subprocess.
--quick: tiny sizes; on the CPU a smoke test of (a) only (no streams: overlapped and serial are the same copies).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from peerline.bench.benchkit import BenchContext, Record, summarize
from peerline.choices import DEVICES

log = logging.getLogger(__name__)

SUITE = "single"
GOAL_OF_BOUND = 0.85
GOAL_VS_SERIAL = 2.0


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--single-hidden", type=int, default=None, help="copy-heavy config: hidden size (128)")
    group.add_argument("--single-seq", type=int, default=None, help="copy-heavy config: tokens per sequence (8192)")
    group.add_argument("--single-mbs", type=int, default=None, help="copy-heavy config: sequences per microbatch")
    group.add_argument("--single-layers", type=int, default=None, help="layers (default: calibrated)")
    group.add_argument("--single-stages", type=int, default=None, help="stages on the GPU (default 2)")


def _cfg(**kw: Any):
    from peerline.distributed.config import RunConfig

    return RunConfig(**kw)


def _build(cfg):
    from peerline.distributed.runtime import Runtime

    return Runtime.create(cfg)


def _release(rt) -> None:
    # Not rt.close(): inside launch/bench.py the process group belongs to the bench.
    rt.engine.transport.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_ms(fn, n: int, device: torch.device, reps: int = 3) -> float:
    reps = reps if device.type == "cuda" else 1
    """Median over `reps` of (wall time of n calls of fn, synchronized at both ends) / n."""
    samples = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3 / n)
    return summarize(samples).median_ms


def _stream_ms(fn, stream: torch.cuda.Stream, n: int) -> float:
    """GPU time per call of fn's work on `stream`, n calls bracketed by two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    for _ in range(n):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / n


# -- (a) overlap ----------------------------------------------------------------------------------------------
def _sizes(args: argparse.Namespace, quick: bool, on_gpu: bool) -> dict[str, int]:
    if quick or not on_gpu:
        base = dict(hidden=32, seq=16, micro_batch_size=2, microbatches=4, layers=2, stages=2)
    else:
        base = dict(hidden=128, seq=8192, micro_batch_size=16, microbatches=4, layers=0, stages=2)
    for key, flag in (("hidden", "single_hidden"), ("seq", "single_seq"), ("micro_batch_size", "single_mbs"),
                      ("layers", "single_layers"), ("stages", "single_stages")):
        if getattr(args, flag, None):
            base[key] = getattr(args, flag)
    return base


def _runtime(sizes: dict[str, int], layers: int, device: torch.device):
    kw = dict(sizes, layers=layers)
    # Graphs on (the default on a GPU): captured after one eager iteration, with the first feed's result hook.
    kw.update(device=device.type, kernels="torch", dtype="bf16" if device.type == "cuda" else "fp32",
              schedule="gpipe", iters=1000, warmup_iters=1)
    return _build(_cfg(**kw))


def _measure_overlap(rt, device: torch.device, n: int) -> dict[str, float]:
    from peerline.distributed.memory.staging import attach

    on_gpu = device.type == "cuda"
    out: dict[str, float] = {}
    # Serial baseline: every copy on the compute stream, the host waits for each.
    serial = attach(rt, results="outputs", refill=False, overlap=False)
    for _ in range(2):
        rt.run_iteration()
    serial.flush()
    out["serial_ms"] = _wall_ms(lambda: rt.run_iteration(), n, device)
    serial_losses = serial.drain()
    # Overlapped: h2d / compute / d2h streams. attach() detaches the serial feed and shares its result buffers
    # (the graph captured during the serial run writes there).
    feed = attach(rt, results="outputs", refill=False, overlap=True)
    del serial
    for _ in range(2):
        rt.run_iteration()
    feed.flush()

    def overlapped() -> None:
        rt.run_iteration()

    out["overlap_ms"] = _wall_ms(overlapped, n, device)
    feed.flush()
    results = feed.drain()
    out["in_slot_waits"] = feed.in_ring.waits
    if not results or not all(torch.isfinite(r.losses).all() for r in results + serial_losses):
        raise RuntimeError("single: non-finite or missing per-microbatch losses came back")
    if on_gpu:
        main = rt.engine.main_stream
        # Compute alone: the iteration on resident data, as it runs in training (the captured graph once there is
        # one; it holds the result hook's device copies, ~2% here). Eager, the hook is switched off.
        step = rt.graph.replay if rt.graph is not None else rt.engine.iteration
        out["graph"] = float(rt.graph is not None)
        feed.tap_enabled = False
        with torch.cuda.stream(main):
            out["compute_ms"] = _stream_ms(step, main, n)
        feed.tap_enabled = True
        out["h2d_ms"] = _stream_ms(feed.copy_in_alone, rt.streams.h2d, n)
        out["d2h_ms"] = _stream_ms(feed.copy_out_alone, rt.streams.d2h, n)
    else:
        out["compute_ms"] = _wall_ms(rt.engine.iteration, n, device)
        out["h2d_ms"] = out["d2h_ms"] = 0.0
    feed.detach()
    return out


def run_overlap(args: argparse.Namespace, ctx: BenchContext) -> dict[str, float]:
    device = ctx.device
    on_gpu = device.type == "cuda"
    sizes = _sizes(args, ctx.quick, on_gpu)
    n = 2 if (ctx.quick or not on_gpu) else 20  # pipeline fill and drain are amortized over n iterations
    layers = sizes.pop("layers")
    stages = sizes["stages"]
    requested = layers  # calibrated (0 here) or --single-layers; the clamp below may raise it
    if layers == 0:  # calibrate: compute of the iteration about the H2D time
        ctx.step("single: calibrating the layer count")
        probe_layers = max(2, stages)  # every stage needs a layer
        rt = _runtime(sizes, probe_layers, device)
        m = _measure_overlap(rt, device, 3)
        _release(rt)
        del rt
        per_layer = m["compute_ms"] / probe_layers
        # As many layers as keep compute at or under the H2D time: the copies then set the pace, and our own
        # device-to-device hops on the compute stream hide under them.
        layers = requested = max(1, min(24, int(m["h2d_ms"] / per_layer)))
        ctx.note(f"single: calibration with {probe_layers} layers: compute {m['compute_ms']:.2f} ms, H2D "
                 f"{m['h2d_ms']:.2f} ms per iteration -> {layers} layers")
    if layers < stages:
        # Every stage needs a layer (model.split_even). Compute then exceeds the H2D time: the bound is still
        # max(H2D, compute, D2H), measured, so the goals stay meaningful; the record says the count was raised.
        ctx.note(f"single: {layers} layers cannot be split into {stages} stages; using {stages} layers (compute "
                 f"may exceed the H2D time)")
        layers = stages
    ctx.step(f"single: overlap, {layers} layers")
    rt = _runtime(sizes, layers, device)
    m = _measure_overlap(rt, device, n)
    _release(rt)
    bound = max(m["h2d_ms"], m["compute_ms"], m["d2h_ms"])
    c = rt.cfg
    case = (f"h={c.hidden} seq={c.seq} mbs={c.micro_batch_size} M={c.microbatches} L={layers} "
            f"stages={c.stages}")
    tokens = c.micro_batch_size * c.seq * c.microbatches
    h2d_bytes = 2 * tokens * c.hidden * 4  # inputs + targets, fp32
    sizes_rec = dict(hidden=c.hidden, seq=c.seq, micro_batch_size=c.micro_batch_size, microbatches=c.microbatches,
                     layers=layers, stages=c.stages)
    extra = {k: round(v, 4) for k, v in m.items()}
    # The record says when the layer count was raised to the stage count (calibration or --single-layers asked
    # for fewer): the run is then more compute-bound than the copy-heavy case intends.
    extra.update(layers=layers, layers_requested=requested, layers_clamped_to_stages=float(requested < layers))
    extra.update(bound_ms=bound, fraction_of_bound=bound / m["overlap_ms"], vs_serial=m["serial_ms"] / m["overlap_ms"],
                 h2d_GBps=h2d_bytes / (m["h2d_ms"] * 1e-3) / 1e9 if m["h2d_ms"] else 0.0,
                 tokens_per_s=tokens / (m["overlap_ms"] * 1e-3))
    ctx.record(Record(SUITE, f"overlap vs bound, {case}", "ms/iter", m["overlap_ms"], bound,
                      "bound max(H2D, compute, D2H)", higher_is_better=False, sizes=sizes_rec, extra=extra))
    ctx.record(Record(SUITE, f"overlap vs serial, {case}", "ms/iter", m["overlap_ms"], m["serial_ms"],
                      "serial (one stream, sync copies)", higher_is_better=False, sizes=sizes_rec, extra=extra))
    ctx.note(f"single: H2D {m['h2d_ms']:.2f} ms, compute {m['compute_ms']:.2f} ms, D2H {m['d2h_ms']:.2f} ms per "
             f"iteration; overlapped {m['overlap_ms']:.2f} ms = {100 * bound / m['overlap_ms']:.1f}% of the bound "
             f"(goal {100 * GOAL_OF_BOUND:.0f}%), serial {m['serial_ms']:.2f} ms = "
             f"{m['serial_ms'] / m['overlap_ms']:.2f}x (goal {GOAL_VS_SERIAL:g}x)")
    return extra


# -- (b) allocator ----------------------------------------------------------------------------------------------
ALLOC_VARIANTS = (("caching", None), ("async", None), ("async", 0))


def alloc_child(kind: str, threshold: int | None, quick: bool, out_path: str) -> None:
    """Runs in a fresh process after configure_allocator(kind, threshold): per-iteration times with scratch."""
    from peerline.bench.load import ScratchJitter
    from peerline.distributed.memory.allocator import allocation_count, allocator_stats, apply_release_threshold

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    apply_release_threshold(device, threshold)
    if quick:
        cfg = _cfg(hidden=64, layers=2, seq=64, micro_batch_size=2, microbatches=4, stages=2, kernels="torch",
                   device="cuda", schedule="1f1b", iters=1000, graph=False,
                   allocator=kind, pool_release_threshold=threshold)
        warm, iters = 2, 6
    else:
        # Eager: a replayed graph allocates nothing, so the allocators would not differ.
        cfg = _cfg(hidden=512, layers=4, seq=1024, micro_batch_size=4, microbatches=8, stages=2, kernels="torch",
                   device="cuda", schedule="1f1b", iters=1000, graph=False,
                   allocator=kind, pool_release_threshold=threshold)
        warm, iters = 3, 30
    rt = _build(cfg)
    jit = ScratchJitter(0.5, cfg.microbatches).install([s.module for s in rt.engine.stages.values()])
    for _ in range(warm):
        rt.run_iteration()
    torch.cuda.synchronize()
    before = allocation_count(device)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.run_iteration()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        allocation_count(device)  # samples pool growth (async)
    loss = rt.read_loss()
    t = summarize(times)
    stats = allocator_stats(device)
    res = dict(kind=kind, threshold=threshold, median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms,
               spread=t.spread, max_ms=max(times), allocs_total=allocation_count(device),
               allocs_timed=allocation_count(device) - before, scratch_sizes=len(set(jit.sizes)), loss=loss,
               iters=iters, **{k: v for k, v in stats.items() if k != "device_allocs"})
    Path(out_path).write_text(json.dumps(res))
    rt.close()


def run_allocators(args: argparse.Namespace, ctx: BenchContext) -> list[dict[str, Any]]:
    if ctx.device.type != "cuda":
        ctx.note("single: allocator comparison needs CUDA; skipped on the CPU")
        return []
    out_dir = ctx.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind, threshold in ALLOC_VARIANTS:
        name = f"{kind}" + ("" if threshold is None else f"-threshold{threshold}")
        ctx.step(f"single: allocator {name} (fresh process)")
        path = out_dir / f"single_alloc_{name}.json"
        code = ("import sys\n"
                "from peerline.distributed.memory.allocator import configure_allocator\n"
                f"configure_allocator({kind!r}, {threshold!r})\n"
                "from peerline.bench.suites.single import alloc_child\n"
                f"alloc_child({kind!r}, {threshold!r}, {bool(ctx.quick)!r}, {str(path)!r})\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                   "MASTER_PORT", "PYTORCH_CUDA_ALLOC_CONF")}
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
        except subprocess.TimeoutExpired:
            ctx.note(f"single: allocator {name}: timed out")
            continue
        if proc.returncode != 0 or not path.exists():
            ctx.note(f"single: allocator {name} failed (rc {proc.returncode}): {proc.stderr.strip()[-600:]}")
            continue
        rows.append(json.loads(path.read_text()))
    base = next((r for r in rows if r["kind"] == "caching"), None)
    for r in rows:
        name = r["kind"] + ("" if r["threshold"] is None else f", release threshold {r['threshold']}")
        ctx.record(Record(SUITE, f"allocator {name}, seq jitter 0.5", "ms/iter", r["median_ms"],
                          base["median_ms"] if base else float("nan"), "caching allocator",
                          higher_is_better=False, extra=r))
        ctx.note(f"single: allocator {name}: {r['median_ms']:.2f} ms/iter (p10 {r['p10_ms']:.2f}, p90 "
                 f"{r['p90_ms']:.2f}, max {r['max_ms']:.2f}, spread {r['spread']:.3f}); device allocations "
                 f"{r['allocs_total']} in all, {r['allocs_timed']} in the {r['iters']} timed iterations; "
                 f"reserved {r.get('reserved_bytes', 0) / 2**20:.0f} MiB")
    return rows


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    run_overlap(args, ctx)
    run_allocators(args, ctx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--part", choices=("all", "overlap", "allocator"), default="all")
    add_arguments(ap.add_argument_group("sizes"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        print("single: error: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # autosave: a run cut short by the caller's timeout keeps what it measured.
    ctx = BenchContext(out_dir=args.out, device=device, quick=args.quick, autosave_stem=SUITE)
    if args.part in ("all", "overlap"):
        run_overlap(args, ctx)
    if args.part in ("all", "allocator"):
        run_allocators(args, ctx)
    paths = ctx.write(SUITE)
    if paths:
        sys.stdout.write(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
