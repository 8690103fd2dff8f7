"""How a timed block's length changes the per-iteration time of the MLP pipeline: peerline with graphs and torch's
1F1B anchor (bf16 parameters), each timed in blocks of N iterations (barrier, device sync, N iterations with no host
sync of ours, device sync) for several N. A fit T(N) = N * period + overhead separates the steady period from what
each block pays once (the start skew of the ranks, the first iteration's fill, the last one's drain, the loss read).
Per launch it also reports the host's time inside the graph launch call; --graph-loop K times K iterations per
launch instead. INFO lines from rank 0.

    torchrun --nproc_per_node=2 tools/gpu_probes/block_length_probe.py [--config compute --schedule zbv ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from peerline.bench.benchkit import time_blocks
from peerline.bench.ideal import stages_per_rank
from peerline.bench.runtime_timing import first_losses, open_runtime, runtime_block
from peerline.bench.suites.pipeline import CONFIGS
from peerline.bench.suites.torch_pipelining import TorchPipelineAnchor
from peerline.bench.suites.torch_schedules import param_dtype
from peerline.distributed.config import RunConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="compute", choices=sorted(CONFIGS), help="the pipeline suite's shape")
    p.add_argument("--schedule", default="zbv", help="peerline's --schedule (default zbv)")
    p.add_argument("--precision", default="bf16", help="peerline's --precision (default bf16)")
    p.add_argument("--blocks", default="1,2,5,10,20", help="block lengths N (default 1,2,5,10,20)")
    p.add_argument("--graph-loop", type=int, default=1,
                   help="peerline's --graph-loop K: K iterations per host launch (block lengths must be multiples)")
    p.add_argument("--reps", type=int, default=3, help="timed blocks per N (default 3)")
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time torch's 1F1B with bf16 parameters (default on)")
    return p.parse_args(argv)


def sweep(run, blocks: list[int], reps: int, device: torch.device) -> dict[int, float]:
    """Median ms per iteration (slowest rank) for each block length."""
    return {n: time_blocks(run, iters=n, reps=reps, warmup=1, device=device).median_ms for n in blocks}


def fit(times: dict[int, float]) -> tuple[float, float]:
    """Least-squares (period, overhead) of block time N * t(N) = N * period + overhead."""
    ns = sorted(times)
    line = statistics.linear_regression(ns, [n * times[n] for n in ns])
    return line.slope, line.intercept


def report(rank: int, name: str, times: dict[int, float]) -> None:
    if rank != 0:
        return
    rows = ", ".join(f"N={n}: {ms:.2f}" for n, ms in sorted(times.items()))
    if len(times) > 1:
        period, overhead = fit(times)
        rows += f"; fit period {period:.2f} ms, overhead {overhead:.1f} ms per block"
    print(f"INFO {name}: ms/iter {rows}", flush=True)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    s = CONFIGS[a.config]
    blocks = [int(b) for b in a.blocks.split(",")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = RunConfig(schedule=a.schedule, stages=stages_per_rank(a.schedule, world, s.layers),
                    microbatches=s.microbatches, micro_batch_size=s.micro_batch_size, seq=s.seq, hidden=s.hidden,
                    layers=s.layers, seed=s.seed, lr=s.lr, dtype=s.dtype, precision=a.precision, graph=True,
                    graph_loop=a.graph_loop, iters=10**9, log_every=10**9)
    with open_runtime(cfg) as rt:
        rank, device = dist.get_rank(), rt.device
        _, not_captured = first_losses(rt, 2, graph=True)
        if not_captured and device.type == "cuda":
            raise SystemExit(f"block_length_probe: the iteration was not captured: {not_captured}")
        launches: list[float] = []
        if rt.graphs.graph is not None:  # the host's time in each launch call
            torch_graph = rt.graphs.graph.graph
            replay = torch_graph.replay

            def timed_replay() -> None:
                t0 = time.perf_counter()
                replay()
                launches.append((time.perf_counter() - t0) * 1e3)

            torch_graph.replay = timed_replay
        times = sweep(runtime_block(rt), blocks, a.reps, device)
        mode = "eager" if rt.graphs.graph is None else f"graph-loop {a.graph_loop}" if a.graph_loop > 1 else "graph"
        report(rank, f"peerline {a.schedule} {mode} --precision {a.precision}", times)
        if rank == 0 and launches:
            q = statistics.quantiles(launches, n=10)
            print(f"INFO peerline host time in the graph launch: median {statistics.median(launches):.2f} ms, "
                  f"p10 {q[0]:.2f}, p90 {q[-1]:.2f}, max {max(launches):.2f} over {len(launches)} launches",
                  flush=True)
    if a.anchor and world > 1:
        anchor = TorchPipelineAnchor(s, "1f1b", world, 1, rank, device, param_dtype=param_dtype("bf16-params"))
        for _ in range(2):
            anchor.step()
        anchor.read_loss()

        def block(n: int) -> None:
            for _ in range(n):
                anchor.step()

        report(rank, "torch 1f1b bf16-params", sweep(block, blocks, a.reps, device))


if __name__ == "__main__":
    main()
