"""How one GPU shares itself between two compute streams that both have work: the question behind modelling a rank
that runs two pipeline stages (zbv, zb-interleaved), each on its own stream.

Stream A queues --queue GEMMs back to back. Stream B waits for a release event, then runs one GEMM of the same shape
between two timing events. The release comes from a third stream's sleep kernel, so B becomes ready part-way through
one of A's GEMMs, not at a kernel boundary. B's latency (release to end) against one GEMM alone tells the sharing
rule:
- about one GEMM: B's kernel gets the SMs as soon as it is ready (or A's current kernel is short);
- about one GEMM plus the rest of A's current GEMM: kernels go first come, first served;
- about two GEMMs: B and A's next kernels share the SMs evenly while both run.
A's total against its GEMMs alone shows what B cost it. Each case runs with both streams at normal priority, with B
at the device's highest priority, and with A at it; eagerly, and replayed from one CUDA graph (graph nodes keep a
captured stream's priority only where the graph is instantiated to use node priorities). INFO lines only.

    python tools/gpu_probes/stream_sharing_probe.py [--m 4096 --k 4096 --n 16384 --queue 12 --reps 20]
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch

log = logging.getLogger("stream_sharing_probe")

PRIORITIES = {"equal": (0, 0), "B high": (0, -1), "A high": (-1, 0)}  # (A, B); -1: the device's highest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=4096, help="GEMM rows (tokens; default 4096)")
    p.add_argument("--k", type=int, default=4096, help="GEMM inner size (default 4096)")
    p.add_argument("--n", type=int, default=16384, help="GEMM columns (default 16384: a GPT MLP's fc1 at 4096)")
    p.add_argument("--queue", type=int, default=12, help="GEMMs queued on stream A (default 12)")
    p.add_argument("--release", type=float, default=2.5, help="B's release, in GEMMs after A starts (default 2.5)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per case (default 20)")
    return p.parse_args(argv)


class Case:
    """One A/B/C setup; `issue` queues it on the streams (eagerly or under capture)."""

    def __init__(self, args: argparse.Namespace, gemm_ms: float, prio: tuple[int, int], device: torch.device,
                 graph: bool):
        hi = torch.cuda.Stream.priority_range()[1]
        self.a = torch.cuda.Stream(device, priority=hi if prio[0] else 0)
        self.b = torch.cuda.Stream(device, priority=hi if prio[1] else 0)
        self.c = torch.cuda.Stream(device)
        self.x = torch.randn(args.m, args.k, device=device, dtype=torch.bfloat16)
        self.w = torch.randn(args.k, args.n, device=device, dtype=torch.bfloat16)
        self.outs = [torch.empty(args.m, args.n, device=device, dtype=torch.bfloat16) for _ in range(2)]
        self.queue = args.queue
        self.sleep_cycles = int(args.release * gemm_ms * 1e-3 * _clock_hz(device))
        # under capture a timing event is an external record node, read after each replay
        self.ev = {k: torch.cuda.Event(enable_timing=True, external=graph) for k in ("a0", "a1", "rel", "b1")}
        self.release = torch.cuda.Event()

    def issue(self) -> None:
        cur = torch.cuda.current_stream()
        for s in (self.a, self.b, self.c):
            s.wait_stream(cur)
        with torch.cuda.stream(self.c):
            torch.cuda._sleep(self.sleep_cycles)
            self.release.record(self.c)
        with torch.cuda.stream(self.a):
            self.ev["a0"].record(self.a)
            for _ in range(self.queue):
                torch.mm(self.x, self.w, out=self.outs[0])
            self.ev["a1"].record(self.a)
        with torch.cuda.stream(self.b):
            self.b.wait_event(self.release)
            self.ev["rel"].record(self.b)
            torch.mm(self.x, self.w, out=self.outs[1])
            self.ev["b1"].record(self.b)
        for s in (self.a, self.b, self.c):
            cur.wait_stream(s)

    def read(self) -> tuple[float, float, float]:
        """(B's latency from its release, A's total, B's release after A's start), ms."""
        e = self.ev
        return e["rel"].elapsed_time(e["b1"]), e["a0"].elapsed_time(e["a1"]), e["a0"].elapsed_time(e["rel"])


def _clock_hz(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(device), "clock_rate") else 1.98e9


def gemm_alone_ms(args: argparse.Namespace, device: torch.device, reps: int) -> float:
    x = torch.randn(args.m, args.k, device=device, dtype=torch.bfloat16)
    w = torch.randn(args.k, args.n, device=device, dtype=torch.bfloat16)
    out = torch.empty(args.m, args.n, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(args.queue):
            torch.mm(x, w, out=out)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / args.queue)
    return statistics.median(times[3:])


def run_case(case: Case, graph: bool, reps: int) -> tuple[float, float, float]:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        case.issue()
        torch.cuda.synchronize()
        g = None
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                case.issue()
        rows = []
        for _ in range(reps + 3):
            if g is None:
                case.issue()
            else:
                g.replay()
            torch.cuda.synchronize()
            rows.append(case.read())
    rows = rows[3:]
    return tuple(statistics.median(r[i] for r in rows) for i in range(3))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="INFO %(message)s")
    args = parse_args(argv)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gemm = gemm_alone_ms(args, device, args.reps)
    log.info("%s: GEMM [%d x %d] @ [%d x %d] bf16 alone: %.3f ms; A queues %d, B's release after %.1f GEMMs",
             torch.cuda.get_device_name(device), args.m, args.k, args.k, args.n, gemm, args.queue, args.release)
    log.info("%-7s %-6s %12s %12s %12s %10s", "mode", "prio", "B latency", "in GEMMs", "A total", "A extra")
    for graph in (False, True):
        for name, prio in PRIORITIES.items():
            case = Case(args, gemm, prio, device, graph)
            try:
                lat, total, rel = run_case(case, graph, args.reps)
            except RuntimeError as e:  # an event timing a graph node may be refused
                log.info("%-7s %-6s failed: %s", "graph" if graph else "eager", name, str(e).splitlines()[0])
                continue
            log.info("%-7s %-6s %9.3f ms %12.2f %9.3f ms %9.2f  (B released %.2f ms after A's start)",
                     "graph" if graph else "eager", name, lat, lat / gemm, total, total / gemm - args.queue, rel)


if __name__ == "__main__":
    main()
