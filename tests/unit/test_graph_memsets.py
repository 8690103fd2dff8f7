"""The small-memset edit of a captured iteration (cudagraph/edit.py memsets_as_kernels, which memset_nodes.py runs
after capture) on a fake graph: each memset node of at most the limit becomes the kernel node the callback adds,
with the memset's parameters and its edges in and out; larger memsets, other kinds and nodes the runtime cannot
name stay. The kernel nodes themselves need a GPU (tests/gpu/test_graph_memsets_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from peerline.distributed.cudagraph.edit import memsets_as_kernels
from peerline.distributed.cudagraph.memset_nodes import KINDS, wanted
from peerline.kernels.graph_memset import KERNEL_SOURCE
from tests.unit.fake_cuda_graph import FakeRuntime, reaches
from tests.unit.kernel_host import declared_kinds


def _memset(nbytes: int, element_size: int = 4) -> SimpleNamespace:
    return SimpleNamespace(dst=0xA000 + nbytes, value=0, elementSize=element_size, width=nbytes // element_size,
                           height=1, pitch=nbytes)


def test_small_memsets_become_kernel_nodes_with_their_edges() -> None:
    # gemm1 <- memset(4 B) <- ln ; gemm2 <- memset(1 KiB, bytes) ; a big memset (1 MiB) ; an unnamed node
    small, mid, big = _memset(4), _memset(1024, 1), _memset(1 << 20)
    nodes = {1: ("Kernel", None), 2: ("Memset", small), 3: ("Kernel", None), 4: ("Memset", mid),
             5: ("Kernel", None), 6: ("Memset", big), 7: ("Kernel", None), 8: ("Unnamed", None)}
    edges = {(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)}
    rt = FakeRuntime(nodes, edges)
    added: list[tuple[list, SimpleNamespace]] = []

    def add_kernel(graph, deps, params):
        added.append((list(deps), params))
        return rt.add_node(graph, deps, "Kernel", ("pl_graph_memset", params))

    assert memsets_as_kernels(rt, 1, add_kernel, limit=4096) == 2
    got_nodes, got_edges = rt.graphs[1]
    assert [p for _, p in added] == [small, mid]  # the memset's own parameters, in node order
    assert [d for d, _ in added] == [[1], [3]]  # each kernel node depends on what its memset depended on
    assert 2 not in got_nodes and 4 not in got_nodes and got_nodes[6] == ("Memset", big) and 8 in got_nodes
    kernels = [n for n, (kind, payload) in got_nodes.items() if kind == "Kernel" and payload]
    assert len(kernels) == 2
    for k in kernels:  # ordered between the same neighbours as the memset it replaces
        assert reaches(got_edges, 1, k) and reaches(got_edges, k, 5)
    assert reaches(got_edges, 1, 7) and not reaches(got_edges, 7, 1)


def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLINE_GRAPH_MEMSETS", "keep")
    assert wanted() is False
    monkeypatch.setenv("PEERLINE_GRAPH_MEMSETS", "sometimes")
    with pytest.raises(ValueError, match="kernels or keep"):
        wanted()


def test_the_kernel_nodes_pack_the_kernels_parameters() -> None:
    assert KINDS == declared_kinds(KERNEL_SOURCE.read_text(), "pl_graph_memset")
