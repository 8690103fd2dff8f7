"""Diagnostic (one GPU): what does the host pay per cudaGraphLaunch, by the kind and number of kernels captured?

The graph suite measured ~60-70 us per replay() call for the compute-bound step (8 blocks of h=2048), for
peerline's graph and for torch's hand-captured one alike, against ~15 us for the launch-bound step with 4x the
layers. This captures chains of the same node count with different kernels (bf16 GEMMs at h=512 and h=2048, plain
elementwise adds) and prints the median host microseconds of replay() (device synchronized before each call), so
the per-graph cost can be told apart from the per-node cost. INFO lines only; asserts nothing.
"""

from __future__ import annotations

import statistics
import time

import torch

from peerline.distributed.streams import new_stream


def chain(kind: str, hidden: int, nodes: int, tokens: int = 4096):
    """A function that issues `nodes` kernels of `kind` on fresh random data, and the tensors it keeps alive."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    if kind == "gemm":
        w_up = torch.randn(hidden, 4 * hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
        w_down = torch.randn(4 * hidden, hidden, device="cuda", dtype=torch.bfloat16) / (4 * hidden) ** 0.5

        def run():
            y = x
            for i in range(nodes):
                y = y @ (w_up if i % 2 == 0 else w_down)
            return y
    else:
        def run():
            y = x
            for _ in range(nodes):
                y = y + x
            return y
    return run


def replay_us(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, n: int = 30) -> float:
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            graph.replay()
            samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    stream = new_stream(torch.device("cuda", torch.cuda.current_device()))
    cases = [("gemm", 512, 16), ("gemm", 512, 64), ("gemm", 2048, 16), ("gemm", 2048, 64), ("add", 2048, 16),
             ("add", 2048, 64)]
    for kind, hidden, nodes in cases:
        run = chain(kind, hidden, nodes)
        with torch.cuda.stream(stream):
            run()  # warm-up: cuBLAS handles and workspaces outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            run()
        with torch.cuda.stream(stream):
            g.replay()  # first launch uploads the graph
        torch.cuda.synchronize()
        us = replay_us(g, stream)
        print(f"INFO graph launch probe: {kind:4s} h={hidden:4d} x{nodes:3d} nodes: replay() {us:6.1f} us host "
              "(median of 30, device idle before each)", flush=True)
        del g


if __name__ == "__main__":
    main()
