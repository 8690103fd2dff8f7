"""Reading and editing captured CUDA graphs through cuda-bindings (the runtime module is passed in, so the logic
runs against a fake in the CPU tests): a census of node kinds, a copy of a graph with its event nodes replaced by
empty nodes and edges (what graph_loop.py needs to put an iteration into a conditional body), and small memset
nodes replaced in place by kernel nodes (memset_nodes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check(result: tuple, what: str) -> Any:
    """The values after the error code of a cuda-bindings call, or RuntimeError naming the call."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


#: node types CUDA allows in a conditional body (CUDA_CONDITIONAL_NODE_PARAMS)
ALLOWED_IN_BODY = ("Kernel", "Memcpy", "Memset", "Empty", "Graph", "Conditional")


def node_census(rt: Any, graph: int) -> str:
    """'the iteration has N nodes: kinds...; not allowed in a loop body: ...' (why a loop cannot be built), or a
    note that the census failed (it is only a diagnostic)."""
    try:
        kinds: dict[str, int] = {}
        for node in _listing(rt.cudaGraphGetNodes, rt.cudaGraph_t(graph)):
            kind = check(rt.cudaGraphNodeGetType(node), "cudaGraphNodeGetType").name.replace("cudaGraphNodeType", "")
            kinds[kind] = kinds.get(kind, 0) + 1
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the error it explains
        return f"(node census failed: {type(exc).__name__}: {exc})"
    bad = {k: v for k, v in kinds.items() if k not in ALLOWED_IN_BODY}
    shown = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
    return (f"the iteration has {sum(kinds.values())} nodes ({shown}); not allowed in a loop body: "
            + (", ".join(f"{v} {k}" for k, v in sorted(bad.items())) if bad else "none of its kinds"))


def _listing(call: Any, *args: Any) -> list:
    """The list a cuda-bindings 'get N things' call returns (asked once for the count, then for the things)."""
    first = check(call(*args, 0), call.__name__)
    count = first[-1] if isinstance(first, tuple) else first
    if not count:
        return []
    return list(check(call(*args, count), call.__name__)[0])[:count]


def _add_edge(rt: Any, graph: Any, before: Any, after: Any) -> None:
    try:
        check(rt.cudaGraphAddDependencies(graph, [before], [after], None, 1), "cudaGraphAddDependencies")
    except TypeError:  # cuda-bindings 12: no edge data
        check(rt.cudaGraphAddDependencies(graph, [before], [after], 1), "cudaGraphAddDependencies")


def without_event_nodes(rt: Any, graph: int) -> tuple[Any, int]:
    """(a copy of `graph` whose event record / wait nodes are empty nodes, how many were replaced). Each stand-in
    keeps the node's edges; a wait also gets an edge from the stand-ins of the records of its event in this graph
    (the order the event gave). A wait for a record that runs after it (an earlier replay's event) would make a
    cycle, which instantiation refuses: that iteration then replays one per launch."""
    kinds = rt.cudaGraphNodeType
    copy = check(rt.cudaGraphClone(rt.cudaGraph_t(graph)), "cudaGraphClone")
    records: dict[int, list[Any]] = {}
    waits: list[tuple[Any, int]] = []
    for node in _listing(rt.cudaGraphGetNodes, copy):
        err, kind = rt.cudaGraphNodeGetType(node)
        if int(err) != 0:  # seen for the copy-engine transport's stream memory operations (driver-only kind)
            rt.cudaGraphDestroy(copy)
            raise RuntimeError(f"the iteration holds a node the CUDA runtime cannot name ({err}; stream memory "
                               "operations, i.e. the copy-engine transport's flags): it cannot be looped")
        if kind == kinds.cudaGraphNodeTypeEventRecord:
            event = int(check(rt.cudaGraphEventRecordNodeGetEvent(node), "cudaGraphEventRecordNodeGetEvent"))
            records.setdefault(event, []).append(node)
        elif kind == kinds.cudaGraphNodeTypeWaitEvent:
            waits.append((node, int(check(rt.cudaGraphEventWaitNodeGetEvent(node), "cudaGraphEventWaitNodeGetEvent"))))
    stand_in: dict[int, Any] = {}
    for node in [n for group in records.values() for n in group] + [w for w, _ in waits]:
        # Edges are read just before each replacement, so they already name earlier stand-ins.
        before = _listing(rt.cudaGraphNodeGetDependencies, node)
        after = _listing(rt.cudaGraphNodeGetDependentNodes, node)
        check(rt.cudaGraphDestroyNode(node), "cudaGraphDestroyNode")
        empty = check(rt.cudaGraphAddEmptyNode(copy, before, len(before)), "cudaGraphAddEmptyNode")
        for succ in after:
            _add_edge(rt, copy, empty, succ)
        stand_in[int(node)] = empty
    for wait, event in waits:
        for record in records.get(event, []):
            _add_edge(rt, copy, stand_in[int(record)], stand_in[int(wait)])
    return copy, len(stand_in)


def memsets_as_kernels(rt: Any, graph: int, add_kernel: Callable[[Any, list, Any], Any], limit: int) -> int:
    """Replace, in place, each memset node of `graph` that writes at most `limit` bytes by the kernel node
    `add_kernel(graph, dependencies, memset params)` adds, with the memset's edges; returns how many. Nodes the
    runtime cannot name (the copy-engine transport's stream memory operations) are left alone."""
    g = rt.cudaGraph_t(graph)
    memset = rt.cudaGraphNodeType.cudaGraphNodeTypeMemset
    replaced = 0
    for node in _listing(rt.cudaGraphGetNodes, g):
        err, kind = rt.cudaGraphNodeGetType(node)
        if int(err) != 0 or kind != memset:
            continue
        params = check(rt.cudaGraphMemsetNodeGetParams(node), "cudaGraphMemsetNodeGetParams")
        if params.elementSize * params.width * params.height > limit:
            continue
        before = _listing(rt.cudaGraphNodeGetDependencies, node)
        after = _listing(rt.cudaGraphNodeGetDependentNodes, node)
        kernel = add_kernel(g, before, params)
        check(rt.cudaGraphDestroyNode(node), "cudaGraphDestroyNode")
        for succ in after:
            _add_edge(rt, g, kernel, succ)
        replaced += 1
    return replaced
