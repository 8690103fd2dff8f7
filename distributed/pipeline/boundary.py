"""A stage boundary: one tensor, or a tuple / list / dict of tensors, and the one message it travels as.

A stage may hand its successor a structure of tensors (floating and integer, e.g. hidden states plus positions or
a mask): a pytree (torch.utils._pytree) of tensors. Transports move one tensor per message, so a boundary of
several tensors travels packed: every leaf copied into one uint8 buffer at an offset aligned to `ALIGN` bytes,
and unpacked on arrival as typed views into the received buffer (no second copy). The gradient travelling back
carries the floating leaves only (integer leaves have none), packed the same way. A message of one tensor (a
single-tensor boundary, or a gradient of one floating leaf) is that tensor itself: no packing, no copy, exactly
the message a single-tensor pipeline sends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.utils._pytree as pytree

from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import TensorSpec

ALIGN = 16  # leaf offsets in a packed message: every dtype's .view() works and vector loads stay aligned
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def _nbytes(spec: TensorSpec) -> int:
    n = spec.dtype.itemsize
    for d in spec.shape:
        n *= d
    return n


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(byte offset of each leaf, total bytes) of a packed message of leaves of `sizes` bytes."""
    offsets, end = [], 0
    for n in sizes:
        start = (end + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(start)
        end = start + n
    return offsets, (end + ALIGN - 1) // ALIGN * ALIGN


def pack(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding every leaf at its aligned offset (padding bytes are left undefined)."""
    offsets, total = layout([t.numel() * t.element_size() for t in leaves])
    buf = torch.empty(total, dtype=torch.uint8, device=leaves[0].device)
    views = [_view(buf, off, tuple(t.shape), t.dtype) for t, off in zip(leaves, offsets)]
    torch._foreach_copy_(views, [t.detach() for t in leaves])  # one multi-tensor launch where dtypes allow
    return buf


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The leaves of a packed message: typed views into `buffer` (uint8, laid out by `layout`)."""
    offsets, total = layout([_nbytes(s) for s in specs])
    if buffer.dtype != torch.uint8 or buffer.numel() != total:
        raise ValueError(f"packed message of {total} bytes expected, got {tuple(buffer.shape)} {buffer.dtype}")
    return [_view(buffer, off, s.shape, s.dtype) for s, off in zip(specs, offsets)]


def _view(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return buf[offset:offset + _nbytes(TensorSpec(shape, dtype))].view(dtype).view(shape)


@dataclass(frozen=True)
class BoundarySpec:
    """The structure (treedef) and the shape and dtype of every leaf of what a stage hands on."""

    treedef: pytree.TreeSpec
    leaves: tuple[TensorSpec, ...]

    @classmethod
    def of_tensor(cls, spec: TensorSpec) -> BoundarySpec:
        """A single-tensor boundary."""
        return cls(pytree.tree_structure(torch.empty(())), (spec,))

    @classmethod
    def of(cls, value: Any, where: str) -> BoundarySpec:
        """The spec of a stage's output `value`; one ConfigError line naming `where` and the leaf when a leaf is
        not a tensor of a supported dtype."""
        flat, treedef = pytree.tree_flatten_with_path(value)
        for path, leaf in flat:
            name = pytree.keystr(path) or "output"
            if not isinstance(leaf, torch.Tensor):
                raise ConfigError(f"{where} gives {type(leaf).__name__} at {name}: a stage hands on a tensor or a "
                                  "tuple / list / dict of tensors")
            if leaf.dtype not in DTYPES.values():
                raise ConfigError(f"{where} gives {leaf.dtype} at {name}: stage boundaries carry "
                                  f"{', '.join(DTYPES)}")
        return cls(treedef, tuple(TensorSpec(tuple(t.shape), t.dtype) for _, t in flat))

    # -- what travels --------------------------------------------------------------------------------------
    @cached_property
    def is_tensor(self) -> bool:
        """A single tensor, not a structure: the engine's original path (asked several times per microbatch; the
        spec is frozen, so it is worked out once)."""
        return self.treedef.is_leaf()

    @cached_property
    def float_index(self) -> tuple[int, ...]:
        """Indices of the floating leaves: those that take and give gradients."""
        return tuple(i for i, s in enumerate(self.leaves) if s.dtype.is_floating_point)

    @property
    def message(self) -> TensorSpec:
        """The activation message: the one leaf itself, or every leaf packed."""
        return _message(self.leaves)

    @property
    def grad_message(self) -> TensorSpec:
        """The gradient message: the floating leaves, packed unless there is one."""
        return _message([self.leaves[i] for i in self.float_index])

    @property
    def shape(self) -> tuple[int, ...]:
        """The first leaf's shape (a single tensor's: what target buffers and output staging are sized by)."""
        return self.leaves[0].shape

    @property
    def dtype(self) -> torch.dtype:
        """The first leaf's dtype."""
        return self.leaves[0].dtype

    def check_passable(self, where: str) -> None:
        """A boundary between stages must carry a floating leaf, or no gradient could flow back across it."""
        if not self.float_index:
            raise ConfigError(f"{where} hands on no floating-point tensor ({self.describe()}), so no gradient "
                              "can flow back to it")

    # -- checks and descriptions ---------------------------------------------------------------------------
    def mismatch(self, value: Any) -> str | None:
        """None when `value` has this structure and every leaf this shape and dtype, else what differs."""
        flat, treedef = pytree.tree_flatten_with_path(value)
        if treedef != self.treedef:
            return f"structure {BoundarySpec.of(value, 'the stage').describe()}"
        for (path, leaf), spec in zip(flat, self.leaves):
            if tuple(leaf.shape) != spec.shape or leaf.dtype != spec.dtype:
                return f"{pytree.keystr(path)} {tuple(leaf.shape)} {leaf.dtype} where the first gave " \
                       f"{spec.shape} {spec.dtype}"
        return None

    def describe(self) -> str:
        """The structure with each leaf's shape and dtype, in one line."""
        specs = iter(self.leaves)
        shown = pytree.tree_unflatten([_Shown(next(specs)) for _ in self.leaves], self.treedef)
        return repr(shown)

    def to_json(self) -> str:
        return json.dumps({"tree": pytree.treespec_dumps(self.treedef),
                           "leaves": [[list(s.shape), str(s.dtype).removeprefix("torch.")] for s in self.leaves]})

    @classmethod
    def from_json(cls, text: str) -> BoundarySpec:
        d = json.loads(text)
        return cls(pytree.treespec_loads(d["tree"]),
                   tuple(TensorSpec(tuple(shape), DTYPES[dtype]) for shape, dtype in d["leaves"]))


@dataclass(frozen=True)
class _Shown:
    spec: TensorSpec

    def __repr__(self) -> str:
        return f"{self.spec.shape} {str(self.spec.dtype).removeprefix('torch.')}"


def _message(specs: Sequence[TensorSpec]) -> TensorSpec:
    if len(specs) == 1:
        return specs[0]
    return TensorSpec((layout([_nbytes(s) for s in specs])[1],), torch.uint8)


# -- the engine's side: building and taking messages ----------------------------------------------------------

def flatten(value: Any) -> list[torch.Tensor]:
    """The leaves of a boundary value, in the spec's order."""
    return pytree.tree_leaves(value)


def unflatten(leaves: Sequence[torch.Tensor], spec: BoundarySpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec.treedef)


def act_message(value: Any) -> torch.Tensor:
    """The activation message of a stage's output (detached): its one leaf, or every leaf packed."""
    leaves = flatten(value)
    return leaves[0].detach() if len(leaves) == 1 else pack(leaves)


def as_input(leaves: Sequence[torch.Tensor], spec: BoundarySpec) -> Any:
    """The next stage's input from received leaves: floating leaves become autograd leaves that collect the
    gradient to send back; integer leaves pass as they are."""
    taken = [t.detach().requires_grad_(True) if s.dtype.is_floating_point else t
             for t, s in zip(leaves, spec.leaves)]
    return unflatten(taken, spec)


def received_input(message: torch.Tensor, spec: BoundarySpec) -> Any:
    """A received activation message as the next stage's input (typed views into the message)."""
    leaves = [message] if len(spec.leaves) == 1 else unpack(message, spec.leaves)
    return as_input(leaves, spec)


def input_grads(value: Any, spec: BoundarySpec) -> list[torch.Tensor]:
    """The gradients of an input's floating leaves, zeros for a leaf that got none (the message stays static)."""
    leaves = flatten(value)
    return [g if (g := leaves[i].grad) is not None else torch.zeros_like(leaves[i]) for i in spec.float_index]


def grad_message(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradient message from the floating leaves' gradients."""
    return grads[0] if len(grads) == 1 else pack(grads)


def received_grads(message: torch.Tensor, spec: BoundarySpec) -> list[torch.Tensor]:
    """A received gradient message as one gradient per floating leaf of `spec`."""
    if len(spec.float_index) == 1:
        return [message]
    return unpack(message, [spec.leaves[i] for i in spec.float_index])


def backward(output: Any, grads: Sequence[torch.Tensor], spec: BoundarySpec) -> None:
    """Backward from a stage's output structure, given the gradient of each floating leaf. Leaves that do not
    require a gradient (e.g. a float mask made from the data) are skipped."""
    leaves = flatten(output)
    pairs = [(leaves[i], g) for i, g in zip(spec.float_index, grads) if leaves[i].requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
