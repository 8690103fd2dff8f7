"""Find the shape and dtype of every stage boundary by running one microbatch through the pipeline once.

Each rank receives its input spec from the previous rank, runs its stage(s) on random data of that spec (no
gradients, under the run's autocast), and passes its output spec on. This works for any user nn.Sequential and
costs one forward per stage at start-up; it also warms up kernels (and their run-time compilation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from peerline.distributed.p2p.base import TensorSpec

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_MAX_DIMS = 8


def encode_spec(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """A spec as one int64 tensor of fixed length (rank, dims padded with zeros, dtype index), to send."""
    if len(spec.shape) > _MAX_DIMS:
        raise ValueError(f"stage boundary tensors may have at most {_MAX_DIMS} dimensions, got {spec.shape}")
    if spec.dtype not in _DTYPES:
        raise ValueError(f"stage boundary dtype {spec.dtype} is not supported")
    dims = list(spec.shape) + [0] * (_MAX_DIMS - len(spec.shape))
    return torch.tensor([len(spec.shape), *dims, _DTYPES.index(spec.dtype)], dtype=torch.int64, device=device)


def decode_spec(t: torch.Tensor) -> TensorSpec:
    """Inverse of `encode_spec`."""
    v = t.tolist()
    return TensorSpec(tuple(v[1:1 + v[0]]), _DTYPES[v[-1]])


def exchange_boundary_specs(modules: list[nn.Module], first_in: TensorSpec | None, prev_rank: int | None,
                            next_rank: int | None, device: torch.device,
                            autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                            ) -> tuple[TensorSpec, list[TensorSpec]]:
    """(input spec of this rank's first stage, output spec of each of its stages): receive the input spec from
    `prev_rank` (or take `first_in`), run the stages once, send the last output spec on to `next_rank`."""
    if prev_rank is None:
        in_spec = first_in
    else:
        buf = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=device)
        dist.recv(buf, src=prev_rank)
        in_spec = decode_spec(buf)
    outs = []
    spec = in_spec
    for module in modules:
        x = torch.randn(spec.shape, device=device).to(spec.dtype)
        with torch.no_grad(), (autocast() if autocast else contextlib.nullcontext()):
            y = module(x)
        spec = TensorSpec(tuple(y.shape), y.dtype)
        outs.append(spec)
    if next_rank is not None:
        dist.send(encode_spec(spec, device), dst=next_rank)
    return in_spec, outs
