"""Copy-engine transport on two GPUs: `torchrun --nproc_per_node=2 tests/gpu/workers/p2p_check.py
[--json OUT]` (run by tests/gpu/test_p2p_copy_engine.py).

Rank 0 is stage 0, rank 1 stage 1. Every message carries a deterministic pattern (different per message and per
replay) that the receiver recomputes and compares element by element; slots start poisoned with NaN, so a read
before the copy landed or an overwrite of a slot still in use shows up as mismatches. Rank 0 prints one
`PASS p2p.<check>` / `FAIL p2p.<check>` line per check (the log) and, with --json OUT, writes
{check: mismatches summed over both ranks} there; the exit status is 0 only if every check passed.
P2P_CHECK_ONLY=<text> runs only the checks whose name contains it (e.g. decoupled).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec
from peerline.distributed.p2p.collective import CollectiveTransport
from peerline.distributed.p2p.copy_engine import CopyEngineTransport, copy_engine_usable
from peerline.distributed.streams import RankStreams, create_rank_streams

SPIN_CYCLES = 4_000_000  # torch.cuda._sleep: about 2-3 ms at H100/H200 clocks


def pattern(mb: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, salt: int = 0
            ) -> torch.Tensor:
    """Deterministic message content, identical on any GPU (no RNG), distinct per (mb, salt)."""
    n = 1
    for d in shape:
        n *= d
    idx = torch.arange(n, device=device, dtype=torch.int64)
    v = (idx * 2654435761 + (mb + 1) * 40503 + salt * 7919) % 1000003
    return (v.to(torch.float32) - 500000.0).to(dtype).view(shape)


def settle(tr: CopyEngineTransport) -> int:
    """After both ranks finished: 0 if every flag is back in its initial state (all consumed and released)."""
    torch.cuda.synchronize()
    dist.barrier()  # the peer's last releases land in our memory before we read our flags
    return 0 if tr.idle() else 1_000_000


class Pair:
    """The two-stage pipeline of this test: links, streams, and transports built on demand."""

    def __init__(self, rank: int, device: torch.device, streams: RankStreams) -> None:
        self.rank, self.device, self.streams = rank, device, streams

    def links(self, spec: TensorSpec) -> Links:
        return Links(None, 1, None, spec) if self.rank == 0 else Links(0, None, spec, None)

    def transport(self, spec: TensorSpec, n: int, lanes: int = 1, split: bool = False, decoupled: bool = False,
                  **kw) -> CopyEngineTransport:
        """A transport over `lanes` send lanes (the p2p stream plus the rank's extra lanes), split or round robin,
        or decoupled (the last two lanes carry the flags, the others only copies)."""
        t = CopyEngineTransport(self.links(spec), self.device, n, streams=self.streams,
                                lanes=self.streams.p2p_lanes[:lanes - 1], split=split, decoupled=decoupled, **kw)
        assert len(t._lanes) == lanes and t.split == split and t.decoupled == decoupled
        return t


def one_way(p: Pair, *, shape: tuple[int, ...], dtype: torch.dtype, n: int, depth: int, slow: bool,
            capture_safe: bool, lanes: int = 1, split: bool = False, batch_flags: bool = True,
            decoupled: bool = False) -> torch.Tensor:
    """Rank 0 streams n messages to rank 1 through a ring of `depth` slots; returns mismatching elements."""
    spec = TensorSpec(shape, dtype)
    tr = p.transport(spec, n, lanes, split, decoupled, depth=depth, capture_safe=capture_safe,
                     batch_flags=batch_flags)
    bad = torch.zeros((), dtype=torch.int64, device=p.device)
    if batch_flags and not tr._ops.batching:  # cuStreamBatchMemOp refused (logged): the batched path went untested
        bad += 1_000_000_000
    if batch_flags and tr._ops.packed_call is None:  # the set-up probe turned the pre-packed batches off (logged)
        bad += 2_000_000_000
    for mb in range(n):
        if p.rank == 0:
            # A fresh tensor each time, dropped at once: the allocator would hand its memory to the next message
            # while the copy still waits for a free slot, unless the transport keeps it alive (record_stream).
            tr.exchange([(ACT, mb, pattern(mb, shape, dtype, p.device))], [])
        else:
            (got,) = tr.exchange([], [(ACT, mb)])
            if slow:
                torch.cuda._sleep(SPIN_CYCLES)  # the consumer is late: the sender must wait for the slot
            bad += (got != pattern(mb, shape, dtype, p.device)).sum()
            tr.release(ACT, mb)
    tr.finish_iteration()
    bad += settle(tr)
    tr.close()
    return bad


def both_ways(p: Pair, *, n: int, depth: int, capture_safe: bool, lanes: int = 1, split: bool = False,
              decoupled: bool = False) -> torch.Tensor:
    """1F1B-like traffic: each step rank 0 sends activation i and receives gradient i-1, rank 1 receives
    activation i and sends gradient i-1 = 2 * activation(i-1) + 1, in one exchange call per step."""
    shape, dtype = (512, 1024), torch.float32
    spec = TensorSpec(shape, dtype)
    tr = p.transport(spec, n, lanes, split, decoupled, depth=depth, capture_safe=capture_safe)
    bad = torch.zeros((), dtype=torch.int64, device=p.device)
    pending: torch.Tensor | None = None
    for i in range(n + 1):
        if p.rank == 0:
            sends = [(ACT, i, pattern(i, shape, dtype, p.device))] if i < n else []
            recvs = [(GRAD, i - 1)] if i >= 1 else []
            got = tr.exchange(sends, recvs)
            if got:
                bad += (got[0] != pattern(i - 1, shape, dtype, p.device) * 2 + 1).sum()
                tr.release(GRAD, i - 1)
        else:
            sends = [(GRAD, i - 1, pending)] if i >= 1 else []
            got = tr.exchange(sends, [(ACT, i)] if i < n else [])
            if got:
                bad += (got[0] != pattern(i, shape, dtype, p.device)).sum()
                pending = got[0] * 2 + 1
                tr.release(ACT, i)
    tr.finish_iteration()
    bad += settle(tr)
    tr.close()
    return bad


def graph_replays(p: Pair, *, g: int, depth: int, replays: int, lanes: int = 1, split: bool = False,
                  decoupled: bool = False) -> torch.Tensor:
    """One CUDA graph per rank holding g handoffs (slots reused within the graph), replayed with fresh data."""
    shape, dtype = (256, 1024), torch.float32
    spec = TensorSpec(shape, dtype)
    tr = p.transport(spec, g, lanes, split, decoupled, depth=depth, capture_safe=True)
    src = torch.empty((g, *shape), dtype=dtype, device=p.device)
    out = torch.full((g, *shape), float("nan"), dtype=dtype, device=p.device)
    bad = torch.zeros((), dtype=torch.int64, device=p.device)

    def body() -> None:
        for mb in range(g):
            if p.rank == 0:
                tr.exchange([(ACT, mb, src[mb])], [])
            else:
                (got,) = tr.exchange([], [(ACT, mb)])
                out[mb].copy_(got)
                tr.release(ACT, mb)
        tr.finish_iteration()

    def expected(replay: int) -> torch.Tensor:
        return torch.stack([pattern(mb, shape, dtype, p.device, salt=replay) for mb in range(g)])

    if p.rank == 0:
        src.copy_(expected(100))
    body()  # eager warm-up through the same (capture-safe) path
    if p.rank == 1:
        bad += (out != expected(100)).sum()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=p.streams.compute):
        body()
    dist.barrier()
    for r in range(replays):
        if p.rank == 0:
            src.copy_(expected(r))
        else:
            out.fill_(float("nan"))
        graph.replay()
        if p.rank == 1:
            bad += (out != expected(r)).sum()
    bad += settle(tr)
    del graph
    tr.close()
    return bad


def against_nccl(p: Pair, *, n: int, lanes: int = 1, split: bool = False, decoupled: bool = False
                 ) -> torch.Tensor:
    """The same messages through NCCL send/recv and through the copy engine must arrive bit-identical (an odd
    size: split halves of unequal length)."""
    shape, dtype = (1000, 999), torch.bfloat16
    spec = TensorSpec(shape, dtype)
    tr = p.transport(spec, n, lanes, split, decoupled, depth=2)
    nccl = CollectiveTransport(p.links(spec), p.device, n)
    bad = torch.zeros((), dtype=torch.int64, device=p.device)
    for mb in range(n):
        x = torch.randn(shape, device=p.device).to(dtype) if p.rank == 0 else None
        if p.rank == 0:
            tr.exchange([(ACT, mb, x)], [])
            nccl.exchange([(ACT, mb, x)], [])
        else:
            (a,) = tr.exchange([], [(ACT, mb)])
            (b,) = nccl.exchange([], [(ACT, mb)])
            bad += (a.view(torch.int16) != b.view(torch.int16)).sum()  # bitwise, NaN-safe
            tr.release(ACT, mb)
    tr.finish_iteration()
    torch.cuda.synchronize()
    tr.close()
    nccl.close()
    return bad


def host_errors(p: Pair) -> torch.Tensor:
    """Misuse fails on the host with a clear error instead of hanging the GPU."""
    spec = TensorSpec((64, 64), torch.float32)
    tr = p.transport(spec, 4, depth=2)
    failures = 0
    if p.rank == 0:
        for bad_tensor in (torch.zeros(64, 65, device=p.device), torch.zeros(64, 64, device=p.device,
                                                                               dtype=torch.float16)):
            try:
                tr.exchange([(ACT, 0, bad_tensor)], [])
                failures += 1
            except ValueError:
                pass
        try:
            tr.exchange([], [(ACT, 0)])  # stage 0 receives no activations
            failures += 1
        except ValueError:
            pass
    else:
        try:
            tr.release(ACT, 3)  # never received
            failures += 1
        except ValueError:
            pass
    torch.cuda.synchronize()
    tr.close()
    return torch.tensor(failures, dtype=torch.int64, device=p.device)


def main() -> int:
    faulthandler.dump_traceback_later(int(os.environ.get("P2P_CHECK_TIMEOUT", "150")), exit=True)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if int(os.environ["WORLD_SIZE"]) != 2:
        print("p2p_check: error: run with exactly 2 ranks (torchrun --nproc_per_node=2)", file=sys.stderr)
        return 2
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    streams = create_rank_streams(device, p2p_lanes=4)
    p = Pair(rank, device, streams)
    usable = copy_engine_usable(p.links(TensorSpec((1,), torch.float32)), device)
    checks: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("slow_receiver_eager", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48, depth=3,
                                                slow=True, capture_safe=False)),
        ("slow_receiver_capture_safe", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48,
                                                       depth=2, slow=True, capture_safe=True)),
        ("slow_receiver_two_lanes", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48, depth=4,
                                                    slow=True, capture_safe=False, lanes=2)),
        ("fast_receiver_two_lanes", lambda: one_way(p, shape=(64, 1000), dtype=torch.float32, n=200, depth=4,
                                                    slow=False, capture_safe=False, lanes=2)),
        ("slow_receiver_unbatched", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=24, depth=2,
                                                    slow=True, capture_safe=False, batch_flags=False)),
        ("fast_receiver_small_bf16", lambda: one_way(p, shape=(7, 333), dtype=torch.bfloat16, n=300, depth=2,
                                                     slow=False, capture_safe=False)),
        ("depth1_eager", lambda: one_way(p, shape=(300, 301), dtype=torch.float32, n=40, depth=1, slow=True,
                                         capture_safe=False)),
        ("both_ways_eager", lambda: both_ways(p, n=32, depth=2, capture_safe=False)),
        ("both_ways_capture_safe", lambda: both_ways(p, n=32, depth=1, capture_safe=True)),
        ("graph_replays", lambda: graph_replays(p, g=6, depth=2, replays=5)),
        ("graph_replays_two_lanes", lambda: graph_replays(p, g=8, depth=4, replays=5, lanes=2)),
        # split: each message (>= 1 MiB) copied in two halves by two lanes at once, FULL after both
        ("slow_receiver_split", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48, depth=3,
                                                slow=True, capture_safe=False, lanes=2, split=True)),
        ("slow_receiver_split_capture_safe", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=32,
                                                             depth=2, slow=True, capture_safe=True, lanes=2,
                                                             split=True)),
        ("fast_receiver_four_lanes_split", lambda: one_way(p, shape=(512, 1000), dtype=torch.float32, n=200,
                                                           depth=4, slow=False, capture_safe=False, lanes=4,
                                                           split=True)),
        ("slow_receiver_four_lanes_split", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=32,
                                                           depth=3, slow=True, capture_safe=False, lanes=4,
                                                           split=True)),
        ("both_ways_split", lambda: both_ways(p, n=32, depth=2, capture_safe=False, lanes=2, split=True)),
        ("both_ways_split_capture_safe", lambda: both_ways(p, n=16, depth=1, capture_safe=True, lanes=2,
                                                           split=True)),
        ("graph_replays_split", lambda: graph_replays(p, g=6, depth=2, replays=5, lanes=2, split=True)),
        ("graph_replays_four_lanes_split", lambda: graph_replays(p, g=8, depth=4, replays=5, lanes=4,
                                                                 split=True)),
        # decoupled flags: 3 lanes = copies on one stream, FREE and FULL on two more; 4 lanes = copies on two
        ("slow_receiver_decoupled", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48, depth=3,
                                                    slow=True, capture_safe=False, lanes=3, decoupled=True)),
        ("slow_receiver_decoupled_capture_safe", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=32,
                                                                 depth=2, slow=True, capture_safe=True, lanes=3,
                                                                 decoupled=True)),
        ("fast_receiver_decoupled", lambda: one_way(p, shape=(64, 1000), dtype=torch.float32, n=200, depth=4,
                                                    slow=False, capture_safe=False, lanes=3, decoupled=True)),
        ("slow_receiver_decoupled_two_lanes", lambda: one_way(p, shape=(1024, 1000), dtype=torch.float32, n=48,
                                                              depth=4, slow=True, capture_safe=False, lanes=4,
                                                              decoupled=True)),
        ("fast_receiver_decoupled_two_lanes", lambda: one_way(p, shape=(7, 333), dtype=torch.bfloat16, n=300,
                                                              depth=4, slow=False, capture_safe=False, lanes=4,
                                                              decoupled=True)),
        ("depth1_decoupled", lambda: one_way(p, shape=(300, 301), dtype=torch.float32, n=40, depth=1, slow=True,
                                             capture_safe=False, lanes=3, decoupled=True)),
        ("both_ways_decoupled", lambda: both_ways(p, n=32, depth=2, capture_safe=False, lanes=3, decoupled=True)),
        ("both_ways_decoupled_capture_safe", lambda: both_ways(p, n=16, depth=1, capture_safe=True, lanes=4,
                                                               decoupled=True)),
        ("graph_replays_decoupled", lambda: graph_replays(p, g=6, depth=2, replays=5, lanes=3, decoupled=True)),
        ("graph_replays_decoupled_two_lanes", lambda: graph_replays(p, g=8, depth=4, replays=5, lanes=4,
                                                                    decoupled=True)),
        ("against_nccl", lambda: against_nccl(p, n=8)),
        ("against_nccl_split", lambda: against_nccl(p, n=8, lanes=2, split=True)),
        ("against_nccl_decoupled", lambda: against_nccl(p, n=8, lanes=4, decoupled=True)),
        ("host_errors", lambda: host_errors(p)),
    ]
    only = os.environ.get("P2P_CHECK_ONLY")  # e.g. "decoupled": only the checks whose name contains it
    if only:
        checks = [c for c in checks if only in c[0]]
    failed = 0
    results = {"usable": 0 if usable else 1}
    if rank == 0:
        print(f"{'PASS' if usable else 'FAIL'} p2p.usable (copy_engine_usable={usable})", flush=True)
        failed += not usable
    for name, fn in checks:
        try:
            with torch.cuda.stream(streams.compute):
                bad = fn()
                torch.cuda.synchronize()
                dist.all_reduce(bad)
                n_bad = int(bad.item())
        except Exception:  # noqa: BLE001 - report and stop: the peer may be stuck in a collective
            print(f"FAIL p2p.{name} (rank {rank} raised)\n{traceback.format_exc()}", flush=True)
            sys.stdout.flush()
            os._exit(1)
        failed += n_bad != 0
        results[name] = n_bad
        if rank == 0:
            print(f"{'PASS' if n_bad == 0 else 'FAIL'} p2p.{name} ({n_bad} mismatches)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
