"""The small memset nodes of a captured iteration, as kernel nodes.

cuBLASLt and cuDNN put a memset of a few bytes (a counter zeroed) before each of their kernels: in a captured
iteration of the GPT that is one before every GEMM and attention kernel, about 470 per rank and iteration at
8 x 4096. On an H200 the GPU starts a memset node about 4.8 us after its predecessor ends and a kernel node about
0.45 us after, so those memsets cost about 2 ms an iteration in gaps (the pp=2 profiles in docs/benchmarks/h200-x2).
Transformer Engine replaces its own 4-byte memsets by a fill kernel for the same reason (nvte_memset). Here, after
capture and before instantiation, each memset node of at most LIMIT bytes becomes a kernel node of
kernels/graph_memset.cu with the same parameters and edges (cudagraph/edit.py: memsets_as_kernels).
PEERLINE_GRAPH_MEMSETS=keep leaves them as they are.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from peerline import overrides
from peerline.distributed.cudagraph.edit import check, memsets_as_kernels
from peerline.kernels.launch import ArgPack

LIMIT = 4096  # bytes (cuBLASLt's and cuDNN's counters are 4, cub's 1024); a larger memset stays a memset node
_THREADS = 128  # one block: at most LIMIT elements, 32 each
KINDS = "piiqqq"  # pl_graph_memset's parameters as launch.ArgPack letters


def wanted() -> bool:
    """Whether captured iterations get the edit: PEERLINE_GRAPH_MEMSETS is not "keep" and cuda-bindings is there
    (its driver API adds the kernel nodes). ValueError naming the choices for anything else."""
    choice = overrides.get_str("PEERLINE_GRAPH_MEMSETS", "kernels").strip().lower()
    if choice not in ("kernels", "keep"):
        raise ValueError(f"environment variable PEERLINE_GRAPH_MEMSETS={choice!r}: choose kernels or keep")
    return choice == "kernels" and importlib.util.find_spec("cuda.bindings") is not None


def replace_small_memsets(raw_graph: int, device_index: int) -> tuple[int, list[ArgPack]]:
    """Edit the captured, not yet instantiated cudaGraph_t `raw_graph` in place; returns (how many memset nodes
    became kernel nodes, the argument packs, which the caller keeps with the graph)."""
    from cuda.bindings import driver, runtime

    from peerline.kernels.compile import load_kernel
    from peerline.kernels.graph_memset import KERNEL_SOURCE

    _, function = load_kernel(KERNEL_SOURCE, "pl_graph_memset", device_index)
    packs: list[ArgPack] = []

    def add_kernel(graph: Any, dependencies: list, memset: Any) -> Any:
        pack = ArgPack(KINDS, (int(memset.dst), int(memset.value), int(memset.elementSize), int(memset.width),
                                  int(memset.height), int(memset.pitch)))
        packs.append(pack)
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = driver.CUfunction(function)
        params.gridDimX, params.gridDimY, params.gridDimZ = 1, 1, 1
        params.blockDimX, params.blockDimY, params.blockDimZ = _THREADS, 1, 1
        params.sharedMemBytes = 0
        params.kernelParams = pack.address
        node = check(driver.cuGraphAddKernelNode(driver.CUgraph(int(graph)),
                                                 [driver.CUgraphNode(int(d)) for d in dependencies],
                                                 len(dependencies), params), "cuGraphAddKernelNode")
        return runtime.cudaGraphNode_t(int(node))

    return memsets_as_kernels(runtime, raw_graph, add_kernel, LIMIT), packs
