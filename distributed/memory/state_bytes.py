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


__all__ = ["state_bytes"]
