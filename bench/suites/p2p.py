"""p2p suite: the copy-engine handoff against raw cudaMemcpyPeerAsync and NCCL send/recv, on one pair of GPUs.

Run under torchrun with 2 ranks (`torchrun --nproc_per_node=2 bench/suites/p2p.py --out DIR`). Rank 0 sends to
rank 1. Per message size (64 KiB .. 256 MiB):

  bandwidth  N messages back to back. Each rank first queues all its work, rank 0's behind a gate (a stream
             waiting on a flag word), then a host barrier, then the gate opens: the GPUs run at their own pace,
             not the Python loop's. Timed with CUDA events on rank 0 from the gate to the end of its last send.
             Every variant moves the same N messages of the same bytes from the same source tensor:
             copy engine: the transport with a ring of 4 slots, per message wait FREE + clear FREE (one batched
               driver call), copy, write FULL; rank 1 consumes every message on its compute stream (wait FULL,
               clear, release = write FREE), so the receiver is in the loop. Variants (VARIANTS): 1 lane; 2 lanes
               round robin (slot s on lane s % 2); 1 lane unbatched (one driver call per flag operation, as
               before batching); 2 lanes split (each message's halves copied at once by two
               lanes, FULL after both); 3 and 4 lanes round robin; 4 lanes split (two split groups, round robin);
               decoupled (one stream does only the copies, wait FREE + clear on a second, FULL on a third, joined
               by events); decoupled 2 lanes (copies alternate two streams, flags on two more).
             raw: cudaMemcpyPeerAsync into an IPC-mapped buffer on one stream, nothing else (no flags, no
               receiver: the ceiling of one copy stream); raw split: the same with each message's halves on two
               streams (the ceiling of two copy engines);
             NCCL: the CollectiveTransport (batched isend/irecv, what `--p2p nccl` runs), rank 1 receiving.
  latency    ping-pong of R round trips (rank 1 answers each message once it arrived), one way = time / 2R;
             raw: one cudaMemcpyPeerAsync, start to end, as a floor.
  graph      the cost of one 64 KiB handoff inside a captured CUDA graph of 64 handoffs, against one graph launch
             per handoff (replays timed on the host, both ranks).

Goals: at >= 16 MiB, >= 95% of the raw (one-stream) copy and >= 1.05x NCCL, one GOAL line per variant.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record
from peerline.distributed.p2p import flag_ops as stream_ops
from peerline.distributed.p2p import ipc
from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec
from peerline.distributed.p2p.collective import CollectiveTransport
from peerline.distributed.p2p.copy_engine import CopyEngineTransport
from peerline.distributed.streams import RankStreams, create_rank_streams

log = logging.getLogger(__name__)

SIZES = [(64 << 10) * 4**i for i in range(7)]  # 64 KiB .. 256 MiB
DEPTH = 4
# (name, lanes, split, flag operations batched into one driver call, decoupled flags: the last two lanes are the
# FREE and FULL flag streams, the others copy)
VARIANTS = [("1 lane", 1, False, True, False), ("1 lane unbatched", 1, False, False, False),
            ("2 lanes", 2, False, True, False), ("3 lanes", 3, False, True, False), ("4 lanes", 4, False, True, False),
            ("2 lanes split", 2, True, True, False), ("4 lanes split", 4, True, True, False),
            ("decoupled", 3, False, True, True), ("decoupled 2 lanes", 4, False, True, True)]
MAX_LANES = max(v[1] for v in VARIANTS)
MAX_QUEUED = 48  # messages queued behind a closed gate: the driver's command queue must not fill up
GOAL_FROM = 16 << 20


def fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


class Pair:
    """Rank 0 -> rank 1, with a gate on rank 0 and a host-only (gloo) barrier that never touches the GPUs."""

    def __init__(self, device: torch.device, streams: RankStreams) -> None:
        self.rank, self.device, self.streams = dist.get_rank(), device, streams
        self.gloo = dist.new_group(backend="gloo")
        self.ops = stream_ops.FlagOps()
        self.gate = torch.zeros(16, dtype=torch.int32, device=device)
        self.epoch = 0  # the gate's value: a new one per timed run, so a stale write never opens it

    def lanes(self, n: int) -> list[torch.cuda.Stream]:
        """The extra send lanes of an n-lane variant (made with the rank's streams, distributed/streams.py)."""
        return self.streams.p2p_lanes[:n - 1]

    def links(self, spec: TensorSpec) -> Links:
        return Links(None, 1, None, spec) if self.rank == 0 else Links(0, None, spec, None)

    def host_barrier(self) -> None:
        dist.barrier(group=self.gloo)

    def gated(self, issue: Callable[[], None]) -> float:
        """Queue `issue()` on both ranks, rank 0's behind the gate; open it; return rank 0's milliseconds from
        the gate to the end of its work (`issue` must leave the current stream waiting for all of it)."""
        cur = torch.cuda.current_stream(self.device)
        self.epoch += 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.rank == 0:
            self.ops.wait_eq(cur.cuda_stream, self.gate.data_ptr(), self.epoch)
            start.record(cur)
        issue()
        if self.rank == 0:
            end.record(cur)
        self.host_barrier()  # everything is queued on both GPUs
        if self.rank == 0:
            self.ops.write(self.streams.h2d.cuda_stream, self.gate.data_ptr(), self.epoch)
        torch.cuda.synchronize(self.device)
        self.host_barrier()
        return start.elapsed_time(end) if self.rank == 0 else float("nan")

    def median(self, issue: Callable[[], None], reps: int) -> float:
        # Warm-up without the gate: first calls may set up connections (NCCL) on the host, which must not
        # wait for a GPU held behind a closed gate.
        issue()
        torch.cuda.synchronize(self.device)
        self.host_barrier()
        return statistics.median(self.gated(issue) for _ in range(reps))


def _raw_copy(pair: Pair, size: int, n: int, reps: int) -> tuple[float, float, float]:
    """(ms for n raw peer copies on one stream, ms for n copies each split in halves over two streams, ms for one
    copy) on rank 0; nan on rank 1."""
    dst = ipc.DeviceAllocation(size, pair.device) if pair.rank == 1 else None
    handles: list[bytes | None] = [None, None]
    dist.all_gather_object(handles, dst.handle() if dst else None, group=pair.gloo)
    src = torch.empty(size, dtype=torch.uint8, device=pair.device)
    peer = ipc.PeerMapping(handles[1], pair.device) if pair.rank == 0 else None
    p2p = pair.streams.p2p
    uuids = _gather_uuid(pair)  # collective: every rank calls it
    peer_dev = ipc.find_device(uuids[1]) if pair.rank == 0 else -1

    lane = pair.streams.p2p_lanes[0]
    half = size // 2 // 256 * 256

    def copy(off: int = 0, nbytes: int = size, stream: torch.cuda.Stream = p2p) -> None:
        ipc.copy_peer(peer.ptr + off, peer_dev, src.data_ptr() + off, pair.device.index, nbytes, stream.cuda_stream,
                      False)

    def issue() -> None:
        if pair.rank == 0:
            cur = torch.cuda.current_stream(pair.device)
            p2p.wait_stream(cur)
            for _ in range(n):
                copy()
            cur.wait_stream(p2p)

    def issue_split() -> None:
        if pair.rank == 0:
            cur = torch.cuda.current_stream(pair.device)
            p2p.wait_stream(cur)
            lane.wait_stream(cur)
            for _ in range(n):
                copy(0, half, p2p)
                copy(half, size - half, lane)
            cur.wait_stream(p2p)
            cur.wait_stream(lane)

    many = pair.median(issue, reps)
    many_split = pair.median(issue_split, reps)
    one = float("nan")
    if pair.rank == 0:
        ones = []
        for _ in range(reps + 1):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(p2p)
            copy()
            e.record(p2p)
            torch.cuda.synchronize(pair.device)
            ones.append(s.elapsed_time(e))
        one = statistics.median(ones[1:])
    pair.host_barrier()
    if peer:
        peer.close()
    pair.host_barrier()
    if dst:
        dst.free()
    return many, many_split, one


def _gather_uuid(pair: Pair) -> list[str]:
    uuids: list[str | None] = [None, None]
    dist.all_gather_object(uuids, ipc.device_uuid(pair.device.index), group=pair.gloo)
    return uuids  # type: ignore[return-value]


def _one_way(pair: Pair, tr, src: torch.Tensor, n: int) -> Callable[[], None]:
    def issue() -> None:
        for i in range(n):
            if pair.rank == 0:
                tr.exchange([(ACT, i, src)], [])
            else:
                tr.exchange([], [(ACT, i)])
                tr.release(ACT, i)
        tr.finish_iteration()
    return issue


def _ping_pong(pair: Pair, tr, src: torch.Tensor, n: int) -> Callable[[], None]:
    def issue() -> None:
        for i in range(n):
            if pair.rank == 0:
                tr.exchange([(ACT, i, src)], [])
                tr.exchange([], [(GRAD, i)])
                tr.release(GRAD, i)
            else:
                tr.exchange([], [(ACT, i)])
                tr.exchange([(GRAD, i, src)], [])
                tr.release(ACT, i)
        tr.finish_iteration()
    return issue


def _nccl_one_way(pair: Pair, tr: CollectiveTransport, src: torch.Tensor, n: int) -> Callable[[], None]:
    def issue() -> None:
        for _ in range(n):
            if pair.rank == 0:
                tr.exchange([(ACT, 0, src)], [])
            else:
                tr.exchange([], [(ACT, 0)])
    return issue


def _nccl_ping_pong(pair: Pair, tr: CollectiveTransport, src: torch.Tensor, n: int) -> Callable[[], None]:
    def issue() -> None:
        for _ in range(n):
            if pair.rank == 0:
                tr.exchange([(ACT, 0, src)], [])
                tr.exchange([], [(GRAD, 0)])
            else:
                tr.exchange([], [(ACT, 0)])
                tr.exchange([(GRAD, 0, src)], [])
    return issue


def bench_size(pair: Pair, ctx: BenchContext, size: int, reps: int, variants: list[tuple] = VARIANTS) -> None:
    n = max(4, min(MAX_QUEUED, (2 << 30) // size))
    rounds = 16 if size <= (4 << 20) else 4
    spec = TensorSpec((size // 2,), torch.bfloat16)
    src = torch.randn(spec.shape, device=pair.device).to(spec.dtype)
    links = pair.links(spec)  # rank 1 receives activations, rank 0 gradients (the ping-pong's answers)

    raw_ms, raw_split_ms, raw_one_ms = _raw_copy(pair, size, n, reps)

    variant_ms: dict[str, float] = {}
    ce_lat_ms = float("nan")
    for name, lanes, split, batch, decoupled in variants:
        ce = CopyEngineTransport(links, pair.device, n, streams=pair.streams, depth=DEPTH, group=pair.gloo,
                                 lanes=pair.lanes(lanes), split=split, batch_flags=batch, decoupled=decoupled)
        variant_ms[name] = pair.median(_one_way(pair, ce, src, n), reps)
        if name == "1 lane":
            ce_lat_ms = pair.median(_ping_pong(pair, ce, src, rounds), reps)
        pair.host_barrier()
        ce.close()

    nccl = CollectiveTransport(links, pair.device, 1)
    nccl_ms = pair.median(_nccl_one_way(pair, nccl, src, n), reps)
    nccl_lat_ms = pair.median(_nccl_ping_pong(pair, nccl, src, rounds), reps)
    del nccl

    if pair.rank != 0:
        return
    gbps = lambda ms: n * size / (ms * 1e-3) / 1e9  # noqa: E731
    bw_raw, bw_raw_split, bw_nccl = gbps(raw_ms), gbps(raw_split_ms), gbps(nccl_ms)
    parts = []
    for name, lanes, split, batch, decoupled in variants:
        bw = gbps(variant_ms[name])
        sizes = {"bytes": size, "messages": n, "depth": DEPTH, "lanes": lanes, "split": split, "batched": batch,
                 "decoupled": decoupled}
        extra = {"raw_peer_copy_GBps": bw_raw, "raw_split_copy_GBps": bw_raw_split, "fraction_of_raw": bw / bw_raw,
                 "fraction_of_raw_split": bw / bw_raw_split}
        ctx.record(Record("p2p", f"bandwidth {fmt(size)} {name}", "GB/s", bw, bw_nccl, "NCCL send/recv",
                          sizes=sizes, extra=extra))
        ctx.record(Record("p2p", f"bandwidth {fmt(size)} {name}", "GB/s", bw, bw_raw, "raw cudaMemcpyPeerAsync",
                          sizes=sizes))
        parts.append(f"{name} {bw:6.1f}")
    ctx.record(Record("p2p", f"bandwidth {fmt(size)} raw split over 2 streams", "GB/s", bw_raw_split, bw_raw,
                      "raw cudaMemcpyPeerAsync", sizes={"bytes": size, "messages": n}))
    ctx.record(Record("p2p", f"latency {fmt(size)}", "us one way", ce_lat_ms * 1e3 / (2 * rounds),
                      nccl_lat_ms * 1e3 / (2 * rounds), "NCCL send/recv ping-pong", higher_is_better=False,
                      sizes={"bytes": size, "round_trips": rounds},
                      extra={"raw_single_copy_us": raw_one_ms * 1e3}))
    for line in goals(ctx, size):  # as soon as the size is done: a bench cut short still reports its goals
        log.info("%s", line)
    log.info("%8s  copy-engine GB/s: %s | raw %6.1f, raw split %6.1f, nccl %6.1f | latency %.1f us (nccl %.1f, "
             "raw copy %.1f)", fmt(size), ", ".join(parts), bw_raw, bw_raw_split, bw_nccl,
             ce_lat_ms * 1e3 / (2 * rounds), nccl_lat_ms * 1e3 / (2 * rounds), raw_one_ms * 1e3)


def bench_graph(pair: Pair, ctx: BenchContext, size: int = 64 << 10, per_graph: int = 64, replays: int = 20
                ) -> None:
    """Per-handoff cost inside one captured graph of `per_graph` handoffs vs one graph launch per handoff."""
    spec = TensorSpec((size // 2,), torch.bfloat16)
    src = torch.randn(spec.shape, device=pair.device).to(spec.dtype)
    results = {}
    for g in (per_graph, 1):
        tr = CopyEngineTransport(pair.links(spec), pair.device, g, streams=pair.streams, depth=DEPTH,
                                 capture_safe=True, group=pair.gloo, lanes=pair.lanes(1))
        body = _one_way(pair, tr, src, g)
        body()  # eager warm-up through the capture-safe path
        torch.cuda.synchronize(pair.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=pair.streams.compute):
            body()
        launches = replays if g > 1 else replays * per_graph
        graph.replay()  # warm-up replay
        torch.cuda.synchronize(pair.device)
        pair.host_barrier()
        t0 = time.perf_counter()
        for _ in range(launches):
            graph.replay()
        torch.cuda.synchronize(pair.device)
        dt = time.perf_counter() - t0
        times: list[float | None] = [None, None]
        dist.all_gather_object(times, dt, group=pair.gloo)
        results[g] = max(times) / (launches * g) * 1e6  # type: ignore[type-var]
        del graph
        pair.host_barrier()
        tr.close()
    if pair.rank == 0:
        ctx.record(Record("p2p", f"graph handoff {fmt(size)}", "us per handoff", results[per_graph], results[1],
                          "one graph launch per handoff", higher_is_better=False,
                          sizes={"bytes": size, "handoffs_per_graph": per_graph, "depth": DEPTH}))
        log.info("graph: %.2f us per 64 KiB handoff in a %d-handoff graph, %.2f us with one graph per handoff",
                 results[per_graph], per_graph, results[1])


def goals(ctx: BenchContext, size: int | None = None) -> list[str]:
    """One line per variant and size >= 16 MiB (or only `size`): GOAL MET / GOAL MISSED for the two bandwidth
    goals."""
    lines = []
    for r in ctx.records:
        if r.case.startswith("bandwidth") and r.anchor_name.startswith("NCCL") and r.sizes["bytes"] >= GOAL_FROM \
                and size in (None, r.sizes["bytes"]):
            frac, vs = r.extra["fraction_of_raw"], r.ratio
            ok = frac >= 0.95 and vs >= 1.05
            lines.append(f"GOAL {'MET' if ok else 'MISSED'} p2p {r.case}: {frac:.3f} of raw (>= 0.95), "
                         f"{vs:.2f}x NCCL (>= 1.05); {r.extra['fraction_of_raw_split']:.3f} of raw split")
    return lines


def skip_reason(args: argparse.Namespace, ctx: BenchContext) -> str | None:
    """Why this machine cannot run the suite (copy engines between two GPUs, driven through cuda-bindings)."""
    if ctx.device.type != "cuda":
        return f"needs CUDA (this run's device is {ctx.device.type})"
    if not stream_ops.available():
        return "needs cuda-bindings (pip install 'peerline[cuda13]')"
    return None


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Suite entry point (needs an initialized 2-rank process group on CUDA)."""
    if dist.get_world_size() != 2:
        raise SystemExit("p2p bench: error: run with exactly 2 ranks (torchrun --nproc_per_node=2)")
    sizes = getattr(args, "sizes", None) or (SIZES[:3] if ctx.quick else SIZES)
    reps = getattr(args, "reps", None) or (3 if ctx.quick else 7)
    names = getattr(args, "p2p_variants", None) or [v[0] for v in VARIANTS]
    unknown = sorted(set(names) - {v[0] for v in VARIANTS})
    if unknown:
        raise SystemExit(f"p2p bench: error: unknown variant(s) {unknown}; known: {[v[0] for v in VARIANTS]}")
    variants = [v for v in VARIANTS if v[0] in names]
    pair = Pair(ctx.device, create_rank_streams(ctx.device, p2p_lanes=MAX_LANES))
    with torch.cuda.stream(pair.streams.compute):
        for size in sizes:
            bench_size(pair, ctx, size, reps, variants)
        bench_graph(pair, ctx)


def add_arguments(group: argparse._ActionsContainer) -> None:
    """Flags of this suite, also under launch/bench.py."""
    names = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    env = os.environ.get("P2P_VARIANTS")  # lets tests/gpu/run_p2p.sh's fixed command line run a few variants
    group.add_argument("--p2p-variants", dest="p2p_variants", type=names, default=names(env) if env else None,
                       help="copy-engine variants, comma separated names of VARIANTS (default: $P2P_VARIANTS, "
                       "else all; raw and NCCL always run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for p2p.jsonl and p2p.md (rank 0)")
    parser.add_argument("--sizes", type=lambda s: [int(x) << 10 for x in s.split(",")], default=None,
                        help="message sizes in KiB, comma separated (default 64 KiB .. 256 MiB)")
    add_arguments(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        print("p2p bench: error: run under torchrun on a machine with 2 GPUs", file=sys.stderr)
        return 2
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(message)s")
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    ctx = BenchContext(out_dir=args.out, device=device, is_writer=dist.get_rank() == 0, quick=args.quick)
    run(args, ctx)
    paths = ctx.write("p2p")
    if paths:
        log.info("wrote %s and %s", *paths)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
