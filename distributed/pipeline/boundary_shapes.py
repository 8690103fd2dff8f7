"""Find the structure, shapes and dtypes of every stage boundary by running one microbatch through the pipeline once.

Each rank receives its input's description (a `BoundarySpec`: the structure and every leaf's shape and dtype)
from the previous rank, runs its stage(s) on data of that spec (random floats, zero integers, which are valid
indices; no gradients, under the run's autocast), and passes its output's description on. This works for any
user nn.Sequential and costs one forward per stage at start-up; it also warms up kernels (and their run-time
compilation). A stage that hands on something no boundary can carry fails on its rank with one ConfigError line,
and the ranks after it receive that line instead of a spec and fail with it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import TensorSpec
from peerline.distributed.pipeline.boundary import BoundarySpec, unflatten


def example_input(spec: BoundarySpec, device: torch.device) -> object:
    """Data of `spec`: standard normal floats, zero integers (a valid index for any embedding or gather)."""
    leaves = [torch.randn(s.shape, device=device).to(s.dtype) if s.dtype.is_floating_point
              else torch.zeros(s.shape, dtype=s.dtype, device=device) for s in spec.leaves]
    return unflatten(leaves, spec)


def send_spec(spec: BoundarySpec | None, error: str | None, dst: int, device: torch.device) -> None:
    """Send a spec (or the error line that stopped this rank) as a length and a UTF-8 JSON payload."""
    payload = ("!" + error if error is not None else spec.to_json()).encode()
    dist.send(torch.tensor([len(payload)], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.tensor(list(payload), dtype=torch.uint8, device=device), dst=dst)


def recv_spec(src: int, device: torch.device) -> BoundarySpec:
    """Receive what `send_spec` sent; re-raise an upstream rank's error line here."""
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src=src)
    payload = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=src)
    text = bytes(payload.cpu().tolist()).decode()
    if text.startswith("!"):
        raise ConfigError(text[1:])
    return BoundarySpec.from_json(text)


def probe_stages(modules: list[nn.Module], in_spec: BoundarySpec, first_index: int, is_end: bool,
                 device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager] | None
                 ) -> list[BoundarySpec]:
    """The output spec of each module run in turn from data of `in_spec`. Every output but the pipeline's last
    (`is_end`) is a boundary and must be one a transport can carry."""
    outs = []
    spec = in_spec
    for i, module in enumerate(modules):
        x = example_input(spec, device)
        with torch.no_grad(), (autocast() if autocast else contextlib.nullcontext()):
            y = module(x)
        where = f"stage {first_index + i}'s output"
        spec = BoundarySpec.of(y, where)
        if not (is_end and i == len(modules) - 1):
            spec.check_passable(where)
        outs.append(spec)
    return outs


def exchange_boundary_specs(modules: list[nn.Module], first_in: TensorSpec | BoundarySpec | None,
                            prev_rank: int | None, next_rank: int | None, device: torch.device,
                            autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                            first_index: int = 0) -> tuple[BoundarySpec, list[BoundarySpec]]:
    """(input spec of this rank's first stage, output spec of each of its stages): receive the input spec from
    `prev_rank` (or take `first_in`), run the stages once, send the last output spec on to `next_rank`.
    `first_index` (the global index of this rank's first stage) only names stages in error lines."""
    try:
        if prev_rank is None:
            in_spec = first_in if isinstance(first_in, BoundarySpec) else BoundarySpec.of_tensor(first_in)
        else:
            in_spec = recv_spec(prev_rank, device)  # an upstream rank's error line is raised here
        outs = probe_stages(modules, in_spec, first_index, next_rank is None, device, autocast)
    except ConfigError as exc:  # the ranks after this one would wait for a spec: hand them the line instead
        if next_rank is not None:
            send_spec(None, str(exc), next_rank, device)
        raise
    if next_rank is not None:
        send_spec(outs[-1], None, next_rank, device)
    return in_spec, outs
