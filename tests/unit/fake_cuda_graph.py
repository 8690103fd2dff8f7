"""A fake of the cuda-bindings runtime calls that cudagraph/edit.py makes, over an in-memory graph, for the CPU
tests of the graph edits (test_graph_loop.py, test_graph_memsets.py)."""

from __future__ import annotations


class FakeRuntime:
    """Just enough of cuda.bindings.runtime for cudagraph/edit.py: a graph is a dict of node -> (kind, payload: an
    event, memset parameters, or None) plus a set of edges; calls return (error, ...) tuples as cuda-bindings
    does. A node of kind "Unnamed" fails cudaGraphNodeGetType, as the driver-only stream memory operations do."""

    class cudaGraphNodeType:  # noqa: N801 - the binding's name
        cudaGraphNodeTypeKernel = "Kernel"
        cudaGraphNodeTypeEventRecord = "EventRecord"
        cudaGraphNodeTypeWaitEvent = "WaitEvent"
        cudaGraphNodeTypeEmpty = "Empty"
        cudaGraphNodeTypeMemset = "Memset"

    def __init__(self, nodes: dict[int, tuple[str, int | None]], edges: set[tuple[int, int]]) -> None:
        self.graphs = {1: (dict(nodes), set(edges))}
        self.owner: dict[int, int] = {n: 1 for n in nodes}
        self.next_id = 1000

    def cudaGraph_t(self, g):  # noqa: N802
        return g

    def cudaGraphClone(self, g):  # noqa: N802
        nodes, edges = self.graphs[g]
        new = max(self.graphs) + 1
        self.graphs[new] = (dict(nodes), set(edges))
        for n in nodes:
            self.owner[n] = new  # node ids are shared by value in this fake; the test only uses the clone
        return 0, new

    def cudaGraphGetNodes(self, g, n):  # noqa: N802
        nodes = sorted(self.graphs[g][0])
        return (0, nodes[:n] if n else None, len(nodes))

    def cudaGraphNodeGetType(self, node):  # noqa: N802
        kind = self.graphs[self.owner[node]][0][node][0]
        return (800, None) if kind == "Unnamed" else (0, kind)

    def cudaGraphMemsetNodeGetParams(self, node):  # noqa: N802
        return 0, self.graphs[self.owner[node]][0][node][1]

    def cudaGraphEventRecordNodeGetEvent(self, node):  # noqa: N802
        return 0, self.graphs[self.owner[node]][0][node][1]

    cudaGraphEventWaitNodeGetEvent = cudaGraphEventRecordNodeGetEvent  # noqa: N815

    def _rel(self, node, n, incoming):
        edges = self.graphs[self.owner[node]][1]
        found = sorted(a if incoming else b for a, b in edges if (b if incoming else a) == node)
        return (0, found[:n] if n else None, None, len(found))

    def cudaGraphNodeGetDependencies(self, node, n):  # noqa: N802
        return self._rel(node, n, True)

    def cudaGraphNodeGetDependentNodes(self, node, n):  # noqa: N802
        return self._rel(node, n, False)

    def cudaGraphDestroyNode(self, node):  # noqa: N802
        nodes, edges = self.graphs[self.owner[node]]
        del nodes[node]
        edges -= {e for e in edges if node in e}
        return (0,)

    def cudaGraphAddEmptyNode(self, g, deps, n):  # noqa: N802
        return 0, self.add_node(g, deps, "Empty", None)

    def add_node(self, g, deps, kind, payload):
        self.next_id += 1
        node = self.next_id
        self.graphs[g][0][node] = (kind, payload)
        self.graphs[g][1].update((d, node) for d in deps)
        self.owner[node] = g
        return node

    def cudaGraphAddDependencies(self, g, before, after, data, n):  # noqa: N802
        self.graphs[g][1].update(zip(before, after))
        return (0,)

    def cudaGraphDestroy(self, g):  # noqa: N802
        return (0,)


def reaches(edges: set[tuple[int, int]], a: int, b: int) -> bool:
    frontier, seen = [a], set()
    while frontier:
        x = frontier.pop()
        for u, v in edges:
            if u == x and v not in seen:
                if v == b:
                    return True
                seen.add(v)
                frontier.append(v)
    return False
