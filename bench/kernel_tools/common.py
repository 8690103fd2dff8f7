"""Timing pieces shared by the kernels benchmark (peerline.bench.suites.kernels) and the sweep (sweep.py).

Each measurement is a CUDA graph of K calls, replayed and timed with CUDA events (per call = replay / K), so it
times device work, not Python launch overhead. Lists timed together run in rotation (benchkit.time_interleaved),
with an untimed L2 scrub (a read of 2 x L2) before each replay, so none pays for another's write-backs. On the CPU
one call is one replay (K = 1), only to smoke-test the flow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from peerline.bench.benchkit import time_interleaved

ROTATE_BYTES = 256 << 20  # input sets per case add up to at least this, so a case does not run out of L2
HIDDEN = 8192  # 4h of h=2048: the width the bias-GELU sees in the compute-bound pipeline config


def captured(calls: list[Callable[[], object]], device: torch.device) -> tuple[Callable[[], object], int]:
    """(replay, K): the K calls captured into one CUDA graph, replayed as one. On the CPU: one call per replay, in
    rotation (K = 1)."""
    if device.type != "cuda":
        i = [0]

        def one() -> None:
            calls[i[0] % len(calls)]()
            i[0] += 1

        return one, 1
    for c in calls:  # eager warm-up: compiles / loads kernels before capture
        c()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph.replay, len(calls)  # the bound method keeps the graph alive as long as the caller holds it


@functools.cache
def _scrub_buffer(index: int) -> torch.Tensor:
    from peerline.kernels import elementwise as ew  # lazy: CUDA only

    return torch.ones(max(1, 2 * ew._l2_bytes(index) // 4), dtype=torch.float32, device=torch.device("cuda", index))


def l2_scrub(device: torch.device) -> Callable[[], object] | None:
    """An untimed step between timed replays: read 2 x L2 of unrelated bytes, so each replay starts with an L2 that
    holds neither the previous replay's data nor its dirty lines (their write-backs happen here, not in the next
    timing). Reads, not writes: the scrub leaves no dirty lines of its own. None on the CPU."""
    if device.type != "cuda":
        return None
    buf = _scrub_buffer(device.index if device.index is not None else torch.cuda.current_device())
    return lambda: buf.sum()


def graph_times(call_lists: list[list[Callable[[], object]]], device: torch.device, reps: int) -> list[float]:
    """Milliseconds per call of each list: each captured into its graph, the replays timed in rotation
    (benchkit.time_interleaved), so ratios between the lists see the same clock drift, with an L2 scrub before
    each replay (l2_scrub), so none of them starts with another's write-backs."""
    replays = [captured(calls, device) for calls in call_lists]
    timings = time_interleaved([r for r, _ in replays], warmup=2, reps=reps, device=device,
                               before_each=l2_scrub(device))
    return [t.median_ms / k for t, (_, k) in zip(timings, replays)]


def graph_time(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Milliseconds per call: K calls captured into one graph, replay timed."""
    return graph_times([calls], device, reps)[0]


def torch_gelu_bwd(g: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's bias+GELU backward, the anchor: gelu_backward and the bias gradient as a separate fp32 sum."""
    gx = torch.ops.aten.gelu_backward(g, v)
    return gx, gx.sum(0, dtype=torch.float32)


def copy_calls(total_bytes: int, device: torch.device, sets: int) -> list[Callable[[], object]]:
    """Device-to-device copies of total_bytes / 2 each (read + written = total_bytes), over `sets` buffer pairs."""
    half = max(1, total_bytes // 2)
    srcs = [torch.empty(half, dtype=torch.uint8, device=device).random_() for _ in range(sets)]
    dsts = [torch.empty(half, dtype=torch.uint8, device=device) for _ in range(sets)]
    return [(lambda i=i: dsts[i].copy_(srcs[i])) for i in range(sets)]
