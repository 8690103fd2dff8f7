"""GPU checks of the copy-engine transport's building blocks (one GPU) and of the transport itself (two GPUs,
through torchrun of tests/gpu/workers/p2p_check.py). Skipped without CUDA, CuPy or cuda-bindings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.gpu.jobs import WORKERS, gpu_env, launcher, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from peerline.distributed.p2p import flag_ops, ipc  # noqa: E402
from peerline.distributed.streams import create_rank_streams, own_streams  # noqa: E402

if not (ipc.available() and flag_ops.available()):
    pytest.skip("needs CuPy and cuda-bindings", allow_module_level=True)


def _load_kernels(dev: torch.device, *streams: torch.cuda.Stream) -> None:
    """Launch once, with nothing waiting, every kernel these tests launch while a flag wait is pending. CUDA loads
    modules lazily (CUDA_MODULE_LOADING=LAZY, the default), and loading a kernel may synchronize the context: a
    first launch on one stream while another stream sits in a flag wait that only that launch would release
    deadlocks (CUDA C++ Programming Guide, Lazy Loading, "Concurrent execution"). Seen on an H200: the
    wait-for-another-stream test hung in three runs."""
    a = torch.zeros(1 << 10, device=dev)
    b = torch.full_like(a, -1.0)
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(1000)
            a.fill_(7.0)
            b.copy_(a)
    torch.cuda.synchronize()


def test_device_allocation_is_a_tensor_over_cudamalloc_memory() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    alloc = ipc.DeviceAllocation(3 * 4096, dev)
    try:
        assert alloc.tensor.data_ptr() == alloc.ptr and alloc.tensor.device == dev
        view = ipc.view_as(alloc.tensor, 4096, (7, 9), torch.bfloat16)
        assert view.data_ptr() == alloc.ptr + 4096
        ref = torch.randn(7, 9, device=dev).to(torch.bfloat16)
        view.copy_(ref)
        assert torch.equal(view, ref)
        assert torch.equal(ipc.view_as(alloc.tensor, 4096, (7, 9), torch.bfloat16), ref)  # same bytes
        assert len(alloc.handle()) == 64  # cudaIpcMemHandle_t
    finally:
        torch.cuda.synchronize()
        alloc.free()


QueueWait = Callable[["flag_ops.FlagOps", int, int], None]


def _copy_behind_a_late_flag(queue_wait: QueueWait) -> tuple[torch.Tensor, list[int]]:
    """queue_wait(ops, p2p stream, flag address) queues the flag operations on the p2p stream; a copy of the
    source follows them there. The compute stream spins ~10 ms, then writes the source, then sets the flag word to
    1. Returns the copy and the flag words 0 and 16 after both streams are done."""
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = create_rank_streams(dev)
    # peerline's own streams (distributed/streams.py), not torch's pool, where a wait like this one hung on an H200
    assert own_streams() and isinstance(streams.p2p, torch.cuda.ExternalStream)
    _load_kernels(dev, streams.p2p, streams.compute)
    ops = flag_ops.FlagOps()
    flag = ipc.DeviceAllocation(128, dev)
    src = torch.zeros(1 << 20, device=dev)
    dst = torch.full_like(src, -1.0)
    try:
        flag.tensor.zero_()
        torch.cuda.synchronize()
        queue_wait(ops, streams.p2p.cuda_stream, flag.ptr)
        with torch.cuda.stream(streams.p2p):
            dst.copy_(src)
        with torch.cuda.stream(streams.compute):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the copy would run now if the wait did not hold it
            src.fill_(7.0)
            ops.write(streams.compute.cuda_stream, flag.ptr, 1)
        torch.cuda.synchronize()
        words = flag.tensor.view(torch.int32)
        return dst, [int(words[0]), int(words[16])]
    finally:
        torch.cuda.synchronize()
        flag.free()


def test_flag_wait_orders_a_copy_after_another_streams_write() -> None:
    """The copy must see the source written by the other stream, never the stale one."""
    dst, words = _copy_behind_a_late_flag(lambda ops, stream, addr: ops.wait_eq(stream, addr, 1))
    assert torch.all(dst == 7.0)
    assert words[0] == 1


def _packing(ops: flag_ops.FlagOps, packed: bool) -> flag_ops.FlagOps:
    """`ops` issuing batches pre-packed (libcuda's cuStreamBatchMemOp_v2, which must load here) or through
    cuda-bindings' list form."""
    if packed:
        assert ops.packed_call is not None, "libcuda's cuStreamBatchMemOp_v2 did not load"
    else:
        ops.packed_call = None
    return ops


@pytest.mark.parametrize("packed", [True, False], ids=["pre-packed", "cuda-bindings"])
def test_batched_wait_and_clear_order_a_copy(packed: bool) -> None:
    """wait FREE + clear FREE as ONE cuStreamBatchMemOp (what every send issues): the copy behind it must wait
    for another stream's late write, and the clear must land after the wait."""
    def queue(ops: flag_ops.FlagOps, stream: int, addr: int) -> None:
        assert ops.probe_batch(stream, addr + 64, 0), "cuStreamBatchMemOp refused"
        _packing(ops, packed).batch(stream, (("wait", addr, 1), ("write", addr, 0), ("write", addr + 64, 3)))

    dst, words = _copy_behind_a_late_flag(queue)
    assert torch.all(dst == 7.0)
    assert words == [0, 3]  # cleared after the wait; the third operation ran too


@pytest.mark.parametrize("packed", [True, False], ids=["pre-packed", "cuda-bindings"])
def test_batched_flag_ops_in_a_captured_graph_replay_correctly(packed: bool) -> None:
    """A batch (wait A == 1, clear A) + copy + write B = 1, captured once and replayed: every replay waits for A
    set by the host, copies the fresh source, and leaves A = 0, B = 1 (a batch-memop node, replayable)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = create_rank_streams(dev)
    _load_kernels(dev, streams.p2p, streams.compute)
    ops = _packing(flag_ops.FlagOps(), packed)
    flag = ipc.DeviceAllocation(128, dev)
    words = flag.tensor.view(torch.int32)
    src = torch.zeros(1 << 18, device=dev)
    dst = torch.empty_like(src)
    try:
        words.zero_()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams.p2p):
            s = torch.cuda.current_stream().cuda_stream
            ops.batch(s, (("wait", flag.ptr, 1), ("write", flag.ptr, 0)))
            dst.copy_(src)
            ops.write(s, flag.ptr + 64, 1)
        for r in range(3):
            src.fill_(float(r + 1))
            dst.fill_(-1.0)
            words.zero_()
            words[0] = 1  # "slot free"
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.all(dst == float(r + 1)), f"replay {r}"
            assert int(words[0]) == 0 and int(words[16]) == 1, f"replay {r}: flags {words[:17:16].tolist()}"
        del graph
    finally:
        torch.cuda.synchronize()
        flag.free()


@pytest.mark.gpu2
def test_copy_engine_transport_on_two_gpus(gpu_out: Path) -> None:
    """Slow/fast receivers, both directions, eager and capture-safe copies, graph replays, lanes round robin,
    split and decoupled, the NCCL comparison and host errors (tests/gpu/workers/p2p_check.py): no mismatch."""
    out = gpu_out / "p2p_check.json"
    out.unlink(missing_ok=True)
    cmd = [*launcher(2), str(WORKERS / "p2p_check.py"), "--json", str(out)]
    rc, tail = run(cmd, gpu_out / "p2p_check.log", 240, gpu_env())
    assert rc == 0 and out.exists(), outcome("p2p_check", rc, tail, 240)
    mismatches = json.loads(out.read_text())
    assert {"usable", "graph_replays", "graph_replays_split", "graph_replays_decoupled"} <= set(mismatches), mismatches
    assert not {k: v for k, v in mismatches.items() if v}, mismatches
