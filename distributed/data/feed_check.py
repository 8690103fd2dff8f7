"""Checks of a token source's batches, so a bad feed is one line that names it instead of an embedding's index
error on the rank that reads it (which the other ranks see as a rank that stopped).

`check_first_batch` runs a user feed's fill once at start-up, on every rank alike before any process group: into
int64 tensors holding -1 (every id must be written, inside the vocabulary; a returned tensor is not written) and
into float64 tensors holding NaN (a feed that makes fractional ids would have them truncated silently by int64
buffers). `checked_fill` wraps a fill so that every batch's ids are checked against the vocabulary (two host
reductions per microbatch): the user feeds and token files whose largest id could not be verified at open.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from peerline.distributed.config import ConfigError

Fill = Callable[[torch.Tensor, torch.Tensor, int, int], None]
UNWRITTEN = -1  # what the first batch's int64 tensors hold before the fill: never a token id


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _call(fill: Fill, name: str, inputs: torch.Tensor, labels: torch.Tensor) -> object:
    try:
        return fill(inputs, labels, 0, 0)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is one line
        raise ConfigError(f"{name} failed on the first batch: fill(inputs, labels, iteration=0, global_mb=0) raised "
                          f"{type(exc).__name__}: {exc}") from None


def check_first_batch(fill: Fill, name: str, shape: tuple[int, int], vocab: int, hint: str = "") -> None:
    """ConfigError naming the feed when its first batch is not int64 ids in [0, vocab) written in place into both
    tensors of `shape`."""
    inputs, labels = (torch.full(shape, UNWRITTEN, dtype=torch.int64) for _ in range(2))
    returned = _call(fill, name, inputs, labels)
    where = f"int64 {list(shape)}, ids 0..{vocab - 1}"
    for what, t in (("inputs", inputs), ("labels", labels)):
        left = int((t == UNWRITTEN).sum())
        if left == t.numel() and returned is not None:
            raise ConfigError(f"{name} returned {_describe(returned)} instead of writing the ids into its inputs and "
                              f"labels tensors ({where}) in place, e.g. inputs.copy_(ids)")
        if left:
            raise ConfigError(f"{name} left {left} of the {t.numel()} ids of {what} ({where}) unwritten on the "
                              "first batch: fill writes every id of both tensors in place")
    check_ids(inputs, labels, vocab, f"{name} wrote", "on the first batch", hint)
    _check_integral(fill, name, shape)


def _check_integral(fill: Fill, name: str, shape: tuple[int, int]) -> None:
    """The first batch once more into float64 tensors: fractional values are floats that int64 tensors truncate."""
    inputs, labels = (torch.full(shape, float("nan"), dtype=torch.float64) for _ in range(2))
    try:
        fill(inputs, labels, 0, 0)
    except Exception:  # noqa: BLE001 - a feed that needs int64 tensors makes no floats
        return
    for what, t in (("inputs", inputs), ("labels", labels)):
        fractional = torch.isfinite(t) & (t != t.round())
        if fractional.any():
            value = t[fractional][0].item()
            raise ConfigError(f"{name} writes floats into {what} ({value:.6g} on the first batch), which int64 ids "
                              f"truncate silently (to {int(value)}): token ids are integers; write int64 ids "
                              "(e.g. .long())")


def check_ids(inputs: torch.Tensor, labels: torch.Tensor, vocab: int, who: str, when: str, hint: str = "") -> None:
    """ConfigError when an id of `inputs` or `labels` is outside [0, vocab): '<who> token id N into <tensor>
    <when>; the vocabulary is V (ids 0..V-1)<hint>'."""
    for what, t in (("inputs", inputs), ("labels", labels)):
        low, high = (int(v) for v in t.aminmax())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ConfigError(f"{who} token id {bad} into {what} {when}; the vocabulary is {vocab} "
                              f"(ids 0..{vocab - 1}){hint}")


def checked_fill(fill: Fill, vocab: int, who: str, hint: str = "") -> Fill:
    """`fill`, with every batch's ids checked against the vocabulary (ConfigError naming the source, the
    iteration as the progress lines count it and the microbatch)."""

    def checked(inputs: torch.Tensor, labels: torch.Tensor, iteration: int, global_mb: int) -> None:
        fill(inputs, labels, iteration, global_mb)
        check_ids(inputs, labels, vocab, who, f"in iteration {iteration + 1}, microbatch {global_mb}", hint)

    return checked


__all__ = ["check_first_batch", "check_ids", "checked_fill", "UNWRITTEN"]
