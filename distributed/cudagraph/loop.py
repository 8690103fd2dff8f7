"""Several training iterations from one host launch: a looped CUDA graph around the captured iteration
(`--graph-loop K`).

Why. cudaGraphLaunch's host cost grows with the node count and the kinds of kernel captured (tens of us per
launch for a compute-bound step; figures in docs/benchmarks). Here the host launches a parent graph whose only node
is a WHILE conditional node; its body is the captured iteration (a child graph) followed by a one-thread kernel
(kernels/graph_loop.cu) that advances a device-side data slot and ends the loop after K iterations. The body lives
on the device from the first upload; the host pays one launch per K iterations.

Data. A looped iteration cannot wait for the host to refill its static buffers. With `--data counter`
(data/counter.py) the captured iteration makes its own data from a device-side iteration counter and advances it:
no host work at all. With the default `--data seeded` the inputs of the next K iterations are generated before
the launch into a device-side ring of K slots (`DataRing.load`, the same seeded data the eager feed writes) and
the captured iteration begins by copying ring[slot] into the static buffers (the slot read on the device); a
single replay uses slot 0, where the loop leaves the slot. Either way K looped iterations run exactly the kernels
of K single replays, on the same data: the GPU tests ask for bitwise equality.

Limits. CUDA allows only kernel, memcpy, memset, empty, child-graph and conditional nodes in a conditional body.
Event record / wait nodes (external events: the bucket timers, the watchdog's arrival marks, NCCL work handles) are
replaced by empty nodes in the looped copy, a wait ordered after its event's records by an edge (so looped
iterations are neither timed nor watched per receive). Stream memory operations (the copy-engine transport's flag
waits/writes) have no such stand-in. Whatever refuses, building the loop fails and the runtime replays one
iteration per launch and says why: one GPU (also --stages N) loops; iterations with NCCL collectives (dp > 1, pp
over NCCL) are refused by cudaGraphInstantiate even with the event nodes stood in (pytorch/pytorch#180960 traces
a similar refusal to NCCL's event-wait nodes; NCCL_GRAPH_MIXING_SUPPORT=0 avoids them, but is not supported here);
the copy-engine transport's memory operations refuse the loop as expected.
Needs a CUDA 12.4+ driver, cuda-bindings and CuPy (the loop kernel is compiled by NVRTC like kernels/).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from peerline.distributed.cudagraph.edit import check, node_census, without_event_nodes
from peerline.kernels.compile import load_kernel

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "graph_loop.cu"  # peerline/kernels
KERNEL_NAME = "pl_graph_loop_next"


class DataRing:
    """K device-side slots of every static input / target buffer of a feed, and the slot the next replayed
    iteration copies from (an int64 on the device, so that the copy can be captured)."""

    def __init__(self, feed: Any, slots: int, device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"a data ring needs >= 1 slots, got {slots}")
        self.feed = feed
        self.slots = slots
        self.inputs = [torch.empty((slots, *b.shape), dtype=b.dtype, device=b.device) for b in feed.inputs]
        self.targets = [torch.empty((slots, *b.shape), dtype=b.dtype, device=b.device) for b in feed.targets]
        # On the device even where this rank holds no buffers (a middle stage): the loop kernel advances it.
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)

    def load(self, first_iteration: int, count: int) -> None:
        """Generate the data of iterations first_iteration .. first_iteration + count - 1 into slots 0 .. count - 1
        (on the current stream, as the feed's own load does)."""
        if not 1 <= count <= self.slots:
            raise ValueError(f"cannot load {count} iterations into a ring of {self.slots} slots")
        for j in range(count):
            self.feed.load_into(first_iteration + j, [r[j] for r in self.inputs], [r[j] for r in self.targets])

    def copy_to_static(self) -> None:
        """Static buffers <- ring[slot], with the slot read on the device (captured at the head of the iteration)."""
        for ring, buf in zip(self.inputs + self.targets, self.feed.inputs + self.feed.targets, strict=True):
            buf.copy_(ring.index_select(0, self.slot).view_as(buf))


class GraphLoop:
    """A parent graph (one WHILE node) that replays `iteration_graph` `per_launch` times per launch, counting in
    `slot` (a device int64 that must be 0 at each launch: it is where the loop leaves it; a DataRing reads it)."""

    def __init__(self, iteration_graph: int, slot: torch.Tensor, per_launch: int, stream: torch.cuda.Stream) -> None:
        from cuda.bindings import driver as cu
        from cuda.bindings import runtime as rt

        if per_launch < 2 or slot.dtype != torch.int64 or slot.device.type != "cuda":
            raise ValueError("a graph loop needs >= 2 iterations per launch and an int64 slot counter on the GPU")
        self._rt = rt
        self.per_launch = per_launch
        self.slot = slot
        self.stream = stream
        self._graph = self._exec = None
        # Loading the module resolves cudaGraphSetConditional, so an old driver fails here, before anything is built.
        _, function = load_kernel(KERNEL_SOURCE, KERNEL_NAME, slot.device.index or 0)
        self._graph = check(rt.cudaGraphCreate(0), "cudaGraphCreate")
        try:
            # The handle starts every launch at 1 (run the body once at least); the loop kernel sets it after that.
            handle = check(rt.cudaGraphConditionalHandleCreate(
                self._graph, 1, int(rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault)),
                "cudaGraphConditionalHandleCreate")
            params = rt.cudaGraphNodeParams()
            params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
            params.conditional.handle = handle
            params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
            params.conditional.size = 1
            _add_root_node(rt, self._graph, params)
            body = params.conditional.phGraph_out[0]
            # Event nodes are not allowed in a conditional body: a copy of the iteration without them (the
            # ordering they gave inside the iteration kept as edges) goes in; torch's graph keeps them.
            source, self.events_removed = without_event_nodes(rt, iteration_graph)
            if self.events_removed:
                log.info("graph loop: %d event nodes of the iteration left out of the loop body (kept as edges)",
                         self.events_removed)
            try:
                child = check(rt.cudaGraphAddChildGraphNode(body, None, 0, source),
                               "cudaGraphAddChildGraphNode (the captured iteration into the loop body)")
            finally:
                rt.cudaGraphDestroy(source)  # the child node holds its own copy
            node = cu.CUDA_KERNEL_NODE_PARAMS()
            node.func = cu.CUfunction(function)
            node.gridDimX = node.gridDimY = node.gridDimZ = 1
            node.blockDimX = node.blockDimY = node.blockDimZ = 1
            node.sharedMemBytes = 0
            node.kernelParams = ((int(handle), slot.data_ptr(), per_launch),
                                 (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64))
            check(cu.cuGraphAddKernelNode(cu.CUgraph(int(body)), [cu.CUgraphNode(int(child))], 1, node),
                   "cuGraphAddKernelNode (the loop kernel)")
            try:
                self._exec = check(rt.cudaGraphInstantiate(self._graph, 0), "cudaGraphInstantiate (the looped graph)")
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; {node_census(rt, iteration_graph)}") from None
            check(rt.cudaGraphUpload(self._exec, self._stream_handle()), "cudaGraphUpload")
        except BaseException:
            self.release()
            raise

    def _stream_handle(self) -> Any:
        return self._rt.cudaStream_t(self.stream.cuda_stream)

    def launch(self) -> None:
        """Run `per_launch` iterations on the loop's stream (one host call; the ring must hold their data)."""
        check(self._rt.cudaGraphLaunch(self._exec, self._stream_handle()), "cudaGraphLaunch (the looped graph)")

    def release(self) -> None:
        """Destroy the executable and the parent graph (the captured iteration stays with its torch graph)."""
        if self._exec is not None:
            self._rt.cudaGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            self._rt.cudaGraphDestroy(self._graph)
            self._graph = None


def _add_root_node(rt: Any, graph: Any, params: Any) -> Any:
    """cudaGraphAddNode with no dependencies; cuda-bindings 13 added the edge-data argument that 12 lacks."""
    try:
        return check(rt.cudaGraphAddNode(graph, None, None, 0, params), "cudaGraphAddNode (WHILE)")
    except TypeError:
        return check(rt.cudaGraphAddNode(graph, None, 0, params), "cudaGraphAddNode (WHILE)")
