"""Tied weights across stages (`--tie-embeddings`): the token embedding on the first stage and the LM head on the
last hold two copies of one weight, which start equal; summing their gradients before every optimizer step (the
same sum on both) keeps them equal, as Megatron-LM's embedding group does.

Across ranks: an all-reduce (sum) over the pair {first stage's rank, last stage's rank} of one replica (Mesh's
embedding group), issued on the main stream by the engine's `before_step`, after the data-parallel average (a sum
of averages is the average of sums). Capturable: a collective on the main stream, no host work. On one rank
holding both stages: a local add into both gradients, the same value the all-reduce gives (a + b == b + a in
floating point), so pp=1 equals pp=2.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn


class TiedGradSum:
    """Called on the main stream before the optimizer step: sums the gradients of the tied copies this rank
    holds (one of the two: with the other rank over `group`; both: locally)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        if not 1 <= len(params) <= 2 or (len(params) == 1) != (group is not None):
            raise ValueError(f"tied weights: {len(params)} local copies with group {group}: one copy needs the "
                             "group of its pair, two need none")
        shapes = {tuple(p.shape) for p in params}
        if len(shapes) != 1:
            raise ValueError(f"tied weights have different shapes: {sorted(shapes)}")
        self.params, self.group = params, group

    def __call__(self) -> None:
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            raise RuntimeError("a tied weight has no gradient: the gradient sync creates .grad before backward")
        if self.group is not None:
            dist.all_reduce(grads[0], op=dist.ReduceOp.SUM, group=self.group)
            return
        total = grads[0] + grads[1]
        grads[0].copy_(total)
        grads[1].copy_(total)


def tied_pair(modules: list[nn.Module], stage_ids: list[int], n_stages: int) -> list[nn.Parameter]:
    """The tied copies among this rank's stages: the embedding weight (layer 0 of stage 0) and the head's
    projection weight (the last layer of the last stage), in that order."""
    found: list[nn.Parameter] = []
    for sid, module in zip(stage_ids, modules):
        if sid == 0:
            found.append(module[0].weight)
        if sid == n_stages - 1:
            found.append(module[-1].out.weight)
    return found


__all__ = ["TiedGradSum", "tied_pair"]
