"""Small memset nodes of a captured graph replaced by kernel nodes (distributed/cudagraph/memset_nodes.py) on a GPU:
memsets issued during capture (4 bytes, 1 KiB of bytes, a 2-D one with a pitch, and 1 MiB, which stays a memset)
write the same bytes as kernel nodes, in the same order against the work around them; and bf16 GEMMs through
cuBLASLt, whose memsets the edit replaces, replay bitwise equal to the same capture unedited."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.cudagraph.memset_nodes import replace_small_memsets

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _kept_graph() -> torch.cuda.CUDAGraph:
    return torch.cuda.CUDAGraph(keep_graph=True)


def test_memset_nodes_write_the_same_bytes_as_kernel_nodes() -> None:
    from cuda.bindings import runtime

    small = torch.empty(4, dtype=torch.uint8, device="cuda")
    mid = torch.empty(1024, dtype=torch.uint8, device="cuda")
    plane = torch.empty(6, 64, dtype=torch.uint8, device="cuda")  # a 2-D memset: 6 rows of 40 bytes, pitch 64
    big = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    seen = torch.empty(4 + 1024 + 6 * 64 + 16, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    graph = _kept_graph()
    with torch.cuda.graph(graph, stream=stream):
        raw = stream.cuda_stream
        for tensor, value in ((small, 0x5A), (mid, 0x11), (big, 0x22)):
            (err,) = runtime.cudaMemsetAsync(tensor.data_ptr(), value, tensor.numel(), raw)
            assert int(err) == 0
        (err,) = runtime.cudaMemset2DAsync(plane.data_ptr(), 64, 0x33, 40, 6, raw)
        assert int(err) == 0
        # work after the memsets reads what they wrote: the order must survive the edit
        torch.cat([small, mid, plane.reshape(-1), big[:16]], out=seen)
    replaced, packs = replace_small_memsets(graph.raw_cuda_graph(), torch.cuda.current_device())
    assert replaced == 3 and len(packs) == 3  # 4 B, 1 KiB and the 240-byte plane; 1 MiB stays a memset
    graph.instantiate()
    for t in (small, mid, plane, big, seen):
        t.fill_(0xEE)  # poison: a byte the replay does not write stays 0xEE
    graph.replay()
    torch.cuda.synchronize()
    want_plane = torch.full((6, 64), 0xEE, dtype=torch.uint8, device="cuda")
    want_plane[:, :40] = 0x33
    assert (small == 0x5A).all() and (mid == 0x11).all() and (big == 0x22).all()
    assert torch.equal(plane, want_plane)
    assert torch.equal(seen, torch.cat([small, mid, plane.reshape(-1), big[:16]]))


def test_gemms_replay_as_the_unedited_graph_does() -> None:
    """bf16 GEMMs captured twice: the edited graph's replay equals the unedited one's, bit for bit."""
    a = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.relu(a @ b) @ b.t()  # warm-up: cuBLAS picks its kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    outputs, replaced = [], []
    for edit in (False, True):
        graph = _kept_graph()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.relu(a @ b) @ b.t()
        if edit:
            replaced.append(replace_small_memsets(graph.raw_cuda_graph(), torch.cuda.current_device())[0])
        graph.instantiate()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outputs.append((graph, out.clone()))
    assert torch.equal(outputs[0][1], outputs[1][1]), f"{replaced[0]} memset nodes replaced"
    assert torch.isfinite(outputs[1][1].float()).all()
