"""Benchmark suite `batch_streams`: the book's multi-stream batch driver, speedup of N streams over one.

    python -m peerline.bench.suites.batch_streams [--out DIR] [--batches 32] [--batch-mib 16] [--streams 1,2,4,8]

Per batch, on stream (batch mod N): cudaMallocAsync (input and output) -> H2D copy from pinned host memory ->
peerline bias+GELU forward (fp32) -> D2H copy into pinned host memory -> cudaFreeAsync. Batches go round-robin
over N non-blocking streams; with N > 1 one batch's H2D, another's kernel and a third's D2H overlap (the copy
engines run both directions at once). Wall time from the first enqueue to a device synchronize after the last
batch, median of a few repetitions after a warm-up; the output of every batch is checked against torch at the end.

Streams: distributed/streams.py is the one place that creates the streams of a rank; this benchmark is the one
exception: it needs N throwaway non-blocking streams that are no rank's roles (torch creates its streams with
cudaStreamNonBlocking).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from peerline.bench.benchkit import BenchContext, Record

log = logging.getLogger(__name__)

SUITE = "batch_streams"
HIDDEN = 4096
_H2D, _D2H = 1, 2  # cudaMemcpyKind
_RELEASE_THRESHOLD = 4  # cudaMemPoolAttrReleaseThreshold


class _DevicePointer:
    """A zero-copy torch view of a raw device allocation (CUDA array interface v2: no stream semantics)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False), "strides": None,
                                         "version": 2}


def _keep_pool_memory(device: torch.device) -> None:
    """Keep freed blocks in the default pool between repetitions, as a long-running driver would."""
    import cupy

    try:
        pool = cupy.cuda.runtime.deviceGetDefaultMemPool(device.index)
        cupy.cuda.runtime.memPoolSetAttribute(pool, _RELEASE_THRESHOLD, 2**63 - 1)
    except Exception as exc:  # noqa: BLE001 - an optimization only; report and go on
        log.warning("batch_streams: could not raise the pool's release threshold: %s", exc)


def _drive(streams: list[torch.cuda.Stream], host_in: torch.Tensor, host_out: torch.Tensor, bias: torch.Tensor,
           batches: int, batch_elems: int) -> None:
    """Enqueue all batches (no host sync inside)."""
    import cupy

    rt = cupy.cuda.runtime
    nbytes = batch_elems * 4
    hin, hout = host_in.data_ptr(), host_out.data_ptr()
    device = bias.device
    with cupy.cuda.Device(device.index):
        _enqueue(rt, streams, hin, hout, bias, batches, batch_elems, nbytes, device)


def _enqueue(rt: Any, streams: list[torch.cuda.Stream], hin: int, hout: int, bias: torch.Tensor, batches: int,
             batch_elems: int, nbytes: int, device: torch.device) -> None:
    from peerline.kernels import elementwise as ew

    for b in range(batches):
        s = streams[b % len(streams)]
        sp = s.cuda_stream
        d_in = rt.mallocAsync(nbytes, sp)
        d_out = rt.mallocAsync(nbytes, sp)
        rt.memcpyAsync(d_in, hin + b * nbytes, nbytes, _H2D, sp)
        x = torch.as_tensor(_DevicePointer(d_in, batch_elems), device=device).view(-1, HIDDEN)
        y = torch.as_tensor(_DevicePointer(d_out, batch_elems), device=device).view(-1, HIDDEN)
        with torch.cuda.stream(s):
            ew.bias_gelu_forward(x, bias, out=y)
        rt.memcpyAsync(hout + b * nbytes, d_out, nbytes, _D2H, sp)
        rt.freeAsync(d_in, sp)
        rt.freeAsync(d_out, sp)


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    """Why this machine cannot run the suite (CUDA and CuPy drive the streams), or None."""
    if ctx.device.type != "cuda":
        return f"needs CUDA (this run's device is {ctx.device.type})"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'peerline[cuda13]')"
    return None


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    device = ctx.device
    if device.type != "cuda":
        log.info("batch_streams: needs CUDA; skipped on %s", device)
        return
    quick = ctx.quick or getattr(args, "quick", False)
    batches = (getattr(args, "batches", None) or 32) if not quick else 4
    batch_mib = (getattr(args, "batch_mib", None) or 16) if not quick else 1
    stream_counts = getattr(args, "stream_counts", None) or (1, 2, 4, 8)
    reps = (getattr(args, "reps", None) or 5) if not quick else 2
    batch_elems = max(HIDDEN, (int(batch_mib * (1 << 20)) // 4) // HIDDEN * HIDDEN)
    total = batches * batch_elems
    host_in = torch.randn(total, pin_memory=True)
    host_out = torch.empty(total, pin_memory=True)
    bias = torch.randn(HIDDEN, device=device)
    _keep_pool_memory(device)
    results: dict[int, float] = {}
    for n in stream_counts:
        streams = [torch.cuda.Stream(device=device) for _ in range(n)]  # benchmark-local (see module doc)
        times = []
        for rep in range(reps + 1):
            host_out.fill_(float("nan"))
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _drive(streams, host_in, host_out, bias, batches, batch_elems)
            torch.cuda.synchronize(device)
            if rep > 0:  # the first is the warm-up (compile, pool growth)
                times.append((time.perf_counter() - t0) * 1e3)
        want = F.gelu(host_in.view(-1, HIDDEN)[:4 * 1024].to(device) + bias).cpu()
        got = host_out.view(-1, HIDDEN)[:4 * 1024]
        last = host_out.view(batches, -1)[-1]
        if not torch.isfinite(host_out).all() or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"batch_streams: wrong output with {n} streams")
        assert torch.isfinite(last).all()
        results[n] = statistics.median(times)
        log.info("batch_streams: %d stream(s): %.2f ms for %d batches of %g MiB", n, results[n], batches,
                 batch_mib)
    base = results[stream_counts[0]]
    moved = 2 * total * 4  # H2D + D2H bytes
    for n, ms in results.items():
        ctx.record(Record(SUITE, f"{batches} batches x {batch_mib:g} MiB, {n} streams", "ms", ms, base,
                          f"{stream_counts[0]} stream(s)", higher_is_better=False,
                          sizes={"batches": batches, "batch_MiB": batch_mib, "streams": n},
                          extra={"speedup": base / ms, "host_device_GBps": moved / (ms * 1e-3) / 1e9}))


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="peerline multi-stream batch driver benchmark")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch-mib", type=float, default=16)
    ap.add_argument("--streams", dest="stream_counts", type=_ints, default=(1, 2, 4, 8))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("batch_streams: error: needs CUDA", file=sys.stderr)
        return 2
    ctx = BenchContext(out_dir=args.out, device=torch.device("cuda", torch.cuda.current_device()),
                       quick=args.quick)
    run(args, ctx)
    ctx.write_and_show(SUITE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
