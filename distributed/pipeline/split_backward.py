"""The backward of one stage and microbatch split in two passes: B (the input gradient) and W (the weight gradients),
for the zero-bubble schedules.

Two forms, chosen per microbatch by what the stage's forward built:

  lean    (fused Linears on their own autograd path hold most of the stage's parameters: every GPU run with
          graphs, and a model of FusedLinear(impl="peerline") on the CPU) B is the whole backward with the fused
          Linears' weight GEMMs queued (kernels/fused_linear.py, Megatron-LM's WeightGradStore); the other
          parameters (LayerNorms, biases, embeddings, plain Linears) get their gradients in B. The graph is freed
          after B, so a microbatch waiting for W holds only each fused Linear's input and output gradient, not its
          activations; W runs the queued GEMMs.
  graph   (otherwise: plain nn.Linear weights, F.linear in eager GPU runs and on the CPU) B runs autograd from the
          stage's output to its input only, keeping the graph. On the way it keeps the gradient that arrives at
          each node where a parameter's branch joins the input's path (an "intermediate"; the same construction
          as torch.distributed.pipelining's stage_backward_input / stage_backward_weight), and fused Linears queue
          their weight GEMMs. W runs autograd from those intermediates, with the kept gradients, to the
          parameters, adds the results into `.grad` and calls the parameters' post-accumulate-grad hooks (the
          bucketed all-reduce counts a gradient final there), then runs the queued weight GEMMs. A stage whose
          input needs no gradient (the first stage's data) does the whole backward in W and nothing in B.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward

from peerline.kernels import fused_linear


def _node(t: torch.Tensor) -> Node | None:
    """The node autograd reaches `t` by: its grad_fn, or a leaf's gradient accumulator."""
    if t.requires_grad and t.grad_fn is None:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return t.grad_fn


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed gradient into it (edges of the backward graph, reversed)."""
    edges: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            edges[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return edges


def _closure(roots: list[Node], stop: set[Node], edges: dict[Node, list[Node]]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `roots` along reversed edges, not entering `stop`; and the `stop` nodes met."""
    seen, met = set(roots), set()
    queue = collections.deque(roots)
    while queue:
        for nxt in edges[queue.popleft()]:
            if nxt in seen:
                continue
            if nxt in stop:
                met.add(nxt)
                continue
            seen.add(nxt)
            queue.append(nxt)
    return seen, met


def _param_groups(input_nodes: list[Node], param_nodes: list[Node], edges: dict[Node, list[Node]]
                  ) -> list[dict[str, Any]]:
    """Parameters grouped by the intermediates (nodes on the input's path) their branches join."""
    on_input_path, _ = _closure(input_nodes, set(), edges)
    by_intermediate: dict[Node, dict[str, Any]] = {}
    for param in param_nodes:
        _, met = _closure([param], on_input_path, edges)
        group = {"params": {param}, "intermediates": met}
        for node in met:
            other = by_intermediate.get(node)
            if other is not None and other is not group:
                other["params"] |= group["params"]
                other["intermediates"] |= group["intermediates"]
                group = other
        for node in group["intermediates"]:
            by_intermediate[node] = group
    unique = {id(g): g for g in by_intermediate.values()}
    return list(unique.values())


def _lean(by_node: dict[Node, torch.nn.Parameter], in_graph: list[Node]) -> bool:
    """Whether B takes the lean form: the stage's forward hid at least half its parameters' elements from autograd
    (fused Linears, whose weight GEMMs B queues), so the weight work autograd still sees is the small part."""
    total = sum(p.numel() for p in by_node.values())
    seen = sum(by_node[n].numel() for n in in_graph)
    return total > 0 and 2 * seen <= total


@dataclass
class Pending:
    """What B leaves for W: the parameter groups with their kept gradients, the queued fused-Linear GEMMs, and
    (a stage whose input needs no gradient) the whole backward."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    queue: list = field(default_factory=list)
    whole: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    # B's outputs, held until W: they own the graph above the intermediates. A custom autograd.Function's node
    # (peerline's kernels, FusedLinear) is reachable from Python only through a weak handle on some torch versions
    # (2.11), so once the engine drops the stage's outputs such an intermediate is freed and W's GradientEdge on
    # it reads "does not require grad and does not have a grad_fn".
    roots: list[torch.Tensor] = field(default_factory=list)


def backward_input(outputs: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor],
                   params: list[torch.nn.Parameter]) -> Pending:
    """B: accumulate the input gradient into each input's .grad; return what W needs."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not pairs:
        return Pending()
    outs, gouts = [o for o, _ in pairs], [g for _, g in pairs]
    edges = _reverse_edges([n for n in map(_node, outs) if n is not None])
    by_node = {_node(p): p for p in params if p.requires_grad}
    param_nodes = [n for n in by_node if n in edges]
    if _lean(by_node, param_nodes):
        with fused_linear.defer_weight_grads() as queue:
            torch.autograd.backward(outs, gouts)
        return Pending(queue=queue)
    if not inputs:
        return Pending(whole=(outs, gouts))
    groups = _param_groups([_node(x) for x in inputs], param_nodes, edges)
    if sum(len(g["params"]) for g in groups) < len(param_nodes):
        # a parameter whose branch never meets the input's path (an output leaf made from parameters alone):
        # no intermediate holds its gradient, so this microbatch runs its whole backward here
        torch.autograd.backward(outs, gouts)
        return Pending()
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def keep(grad_outputs: tuple, group: dict = group, i: int = i) -> None:
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        with fused_linear.defer_weight_grads() as queue:
            dx = torch.autograd.grad(outs, inputs, gouts, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for x, g in zip(inputs, dx):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    return Pending(groups=groups, queue=queue, roots=outs)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in place (the bucket views stay the gradients), then its post-accumulate-grad hooks."""
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _grad_from_edges(outputs: list[GradientEdge], inputs: list[GradientEdge], grads: list[torch.Tensor]
                     ) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(outputs, inputs, grads, allow_unused=True) without its shape check of the grads.

    That check reads `node._input_metadata`, which custom autograd.Function nodes (peerline's kernels) lack on
    some torch versions; the grads here are the ones autograd itself handed to those nodes in B."""
    return _engine_run_backward(tuple(outputs), tuple(grads), False, False, tuple(inputs), True,
                                accumulate_grad=False)


def backward_weight(pending: Pending, params: list[torch.nn.Parameter]) -> None:
    """W: the weight gradients B left, accumulated into .grad with the parameters' hooks."""
    if pending.whole is not None:
        outs, gouts = pending.whole
        torch.autograd.backward(outs, gouts)
        return
    by_node = {_node(p): p for p in params if p.requires_grad}
    for group in pending.groups:
        edges, gouts = [], []
        for kept, node in zip(group["grads"], group["intermediates"]):
            for i, g in enumerate(kept or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    gouts.append(g)
        handles = []
        if len(group["intermediates"]) > 1:  # a kept gradient must not grow again through another intermediate
            for kept, node in zip(group["grads"], group["intermediates"]):
                handles.append(node.register_prehook(lambda _grads, kept=kept: kept))
        try:
            if edges:
                nodes = list(group["params"])
                dws = _grad_from_edges(edges, [GradientEdge(n, 0) for n in nodes], gouts)
                for n, dw in zip(nodes, dws):
                    if dw is not None:
                        _accumulate(by_node[n], dw)
        finally:
            for h in handles:
                h.remove()
    fused_linear.accumulate_deferred(pending.queue)
