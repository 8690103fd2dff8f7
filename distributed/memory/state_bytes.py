"""What a rank holds for the whole run, by kind: parameters, gradients and optimizer state, in bytes (the `--json`
record's `state_bytes`; with the peak memory of the same record, what is left is activations, workspaces and the
allocator's slack).

Tensors are counted by the storage they live in, each storage once: parameters that are views of one flat buffer
(--shard-optimizer) count that buffer, gradients that are views of the buckets count the buckets (their padding
too), and a sharded optimizer's gradient shards count beside them. Optimizer state is every tensor in the
optimizer's `state` (moments, masters, remainders, step counts).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_bytes(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer_state": bytes} held by this rank (see the module doc)."""
    params = list(params)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    seen: set[int] = set()
    parameters = _storage_bytes(params, seen)
    gradients = _storage_bytes([p.grad for p in params] + [p.grad for p in opt_params], seen)
    optimizer_state = _storage_bytes((v for st in optimizer.state.values() for v in st.values()
                                      if torch.is_tensor(v)), seen)
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state}


def per_rank(mine: dict[str, int]) -> dict[str, list[int]]:
    """Every rank's `state_bytes`, by kind and rank (collective over the default group when there is one: a small
    all-gather of Python objects)."""
    everyone: list[dict[str, int] | None] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {kind: [int((d or {}).get(kind, 0)) for d in everyone] for kind in mine}


def describe_split(held: dict[str, list[int]], peak_gb_per_rank: list[float]) -> str:
    """'rank 1 of the highest peak: parameters 2.3, gradients 2.3, optimizer 13.8, the rest 5.1 GiB' (the rest:
    activations, workspaces and the allocator's slack)."""
    if not peak_gb_per_rank or not held.get("parameters"):
        return ""
    rank = max(range(len(peak_gb_per_rank)), key=lambda r: peak_gb_per_rank[r])
    gib = {kind: values[rank] / 2**30 for kind, values in held.items() if rank < len(values)}
    rest = peak_gb_per_rank[rank] - sum(gib.values())
    return (f"rank {rank} (the highest peak): parameters {gib.get('parameters', 0):.2f}, gradients "
            f"{gib.get('gradients', 0):.2f}, optimizer {gib.get('optimizer_state', 0):.2f}, the rest {rest:.2f} GiB")


__all__ = ["describe_split", "per_rank", "state_bytes"]
