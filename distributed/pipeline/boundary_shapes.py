"""Find the structure, shapes and dtypes of every stage boundary by running one microbatch through the pipeline once.

Each rank receives its input's description (a `BoundarySpec`: the structure and every leaf's shape and dtype)
from the previous rank, runs its stage(s) on data of that spec (random floats, zero integers, which are valid
indices; no gradients, under the run's autocast), and passes its output's description on. This works for any
user nn.Sequential and costs one forward per stage at start-up; it also warms up kernels (and their run-time
compilation); the last stage's output may be checked further (`end_check`: a user loss must score it). A stage
that hands on something no boundary can carry (or fails that check) fails on its rank with one ConfigError line;
the ranks after it receive that line instead of a spec, and then every rank agrees (one small all-reduce) whether
any failed: the failing rank prints its line, every other rank exits 2 quietly (`ReportedElsewhere`), so a bad
model is one line from one rank whichever stage it breaks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from peerline.distributed.config import ConfigError, ReportedElsewhere
from peerline.distributed.p2p.base import TensorSpec
from peerline.distributed.pipeline.boundary import DTYPES, BoundarySpec, unflatten


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
        raise ReportedElsewhere(text[1:])
    return BoundarySpec.from_json(text)


def probe_stages(modules: list[nn.Module], in_spec: BoundarySpec, first_index: int, is_end: bool,
                 device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager] | None,
                 end_check: Callable[[object], None] | None = None) -> list[BoundarySpec]:
    """The output spec of each module run in turn from data of `in_spec`. Every output but the pipeline's last
    (`is_end`) is a boundary and must be one a transport can carry; the last goes to `end_check`."""
    outs = []
    spec = in_spec
    for i, module in enumerate(modules):
        try:
            x = example_input(spec, device)
        except (RuntimeError, MemoryError) as exc:  # an input too large for the device: say what and how much
            gib = sum(math.prod(s.shape) * s.dtype.itemsize for s in spec.leaves) / 2**30
            raise ConfigError(f"stage {first_index + i}'s input {spec.describe()} needs {gib:.3g} GiB and cannot be "
                              f"allocated on the {device.type} ({type(exc).__name__}); lower --micro-batch-size, "
                              "--seq or --hidden") from None
        with torch.no_grad(), (autocast() if autocast else contextlib.nullcontext()):
            y = module(x)
        where = f"stage {first_index + i}'s output"
        spec = BoundarySpec.of(y, where)
        if not (is_end and i == len(modules) - 1):
            spec.check_passable(where)
        elif end_check is not None:
            end_check(y)
        outs.append(spec)
    return outs


def exchange_boundary_specs(modules: list[nn.Module], first_in: TensorSpec | BoundarySpec | None,
                            prev_rank: int | None, next_rank: int | None, device: torch.device,
                            autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                            first_index: int = 0, end_check: Callable[[object], None] | None = None
                            ) -> tuple[BoundarySpec, list[BoundarySpec]]:
    """(input spec of this rank's first stage, output spec of each of its stages): receive the input spec from
    `prev_rank` (or take `first_in`), run the stages once, send the last output spec on to `next_rank`.
    `first_index` (the global index of this rank's first stage) only names stages in error lines; `end_check`
    gets the pipeline's last output."""
    error: ConfigError | None = None
    try:
        if prev_rank is None:
            in_spec = first_in if isinstance(first_in, BoundarySpec) else BoundarySpec.of_tensor(first_in)
        else:
            in_spec = recv_spec(prev_rank, device)  # an upstream rank's error line is raised here
        outs = probe_stages(modules, in_spec, first_index, next_rank is None, device, autocast, end_check)
    except ConfigError as exc:  # the ranks after this one would wait for a spec: hand them the line instead
        error = exc
    if next_rank is not None:
        send_spec(None if error else outs[-1], str(error) if error else None, next_rank, device)
    if any_rank_failed(error is not None, device) and error is None:
        raise ReportedElsewhere("another rank's stage does not fit the model (it prints the error)")
    if error is not None:
        raise error
    return in_spec, outs


def any_rank_failed(failed: bool, device: torch.device) -> bool:
    """Whether any rank of the job failed its probe (collective; False for one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def check_layer_output(before: object, after: object, index: int, layer: nn.Module, describe: Callable) -> None:
    """One layer's probe output can travel and be trained through: no dtype a boundary cannot carry (complex),
    and a layer given floats must give back a float, or no gradient reaches the layers before it. Names the layer
    (its index in the whole model and its class) and what it made of its input."""
    leaves = [t for t in _leaves(after)]
    odd = [t for t in leaves if t.dtype not in DTYPES.values()]
    what = f"layer {index} ({type(layer).__name__}) turned {describe(before)} into {describe(after)}"
    if odd:
        raise ConfigError(f"{what}: {str(odd[0].dtype).removeprefix('torch.')} cannot be handed on or scored; stage "
                          f"boundaries carry {', '.join(DTYPES)}")
    if any(t.is_floating_point() for t in _leaves(before)) and not any(t.is_floating_point() for t in leaves):
        raise ConfigError(f"{what}: no floating-point tensor is left, so no gradient can flow back through it")


def _leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for v in value for t in _leaves(v)]
    return []


def exchange_placed_specs(modules: list[nn.Module], stage_ids: list[int], rank_of: Callable[[int], int],
                          n_stages: int, first_in: TensorSpec | BoundarySpec, device: torch.device,
                          autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                          end_check: Callable[[object], None] | None = None
                          ) -> tuple[dict[int, BoundarySpec], dict[int, BoundarySpec]]:
    """Like exchange_boundary_specs for a rank holding several stages that need not be adjacent (interleaved, zbv:
    pipeline/placement.py): the stages run in global order, each receiving its input spec from the rank of the
    stage before it (or the stage itself when local) and sending its output's spec to the rank of the stage after
    it. `rank_of` names global ranks. Returns the input and the output spec of each local stage, by stage."""
    error: ConfigError | None = None
    outs: dict[int, BoundarySpec] = {}
    first_spec = first_in if isinstance(first_in, BoundarySpec) else BoundarySpec.of_tensor(first_in)
    in_specs: dict[int, BoundarySpec] = {}
    for module, s in sorted(zip(modules, stage_ids), key=lambda p: p[1]):
        try:
            if s == 0:
                in_specs[s] = first_spec
            elif rank_of(s - 1) != rank_of(s):
                in_specs[s] = recv_spec(rank_of(s - 1), device)  # an upstream error line is raised here
            elif s - 1 in outs:
                in_specs[s] = outs[s - 1]
            if error is None:
                outs[s] = probe_stages([module], in_specs[s], s, s == n_stages - 1, device, autocast, end_check)[0]
        except ConfigError as exc:
            error = error or exc
        if s + 1 < n_stages and rank_of(s + 1) != rank_of(s):
            send_spec(None if error else outs[s], str(error) if error else None, rank_of(s + 1), device)
    if any_rank_failed(error is not None, device) and error is None:
        raise ReportedElsewhere("another rank's stage does not fit the model (it prints the error)")
    if error is not None:
        raise error
    return in_specs, outs
