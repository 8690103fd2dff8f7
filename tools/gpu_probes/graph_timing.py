"""Device time of a piece of GPU work, captured in a CUDA graph and replayed (the probes' shared timer): no host
launch cost inside the measurement, as in a captured training iteration."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def captured(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured once in a CUDA graph (after two warm-up passes on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def replayed_ms(fn: Callable[[], object], steps: int, reps: int) -> float:
    """Median ms per replay of `fn` captured (captured()), over `reps` blocks of `steps` replays."""
    replay = captured(fn)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)
