"""A user model whose layers hand each other structures of tensors (`--model tuple_model:build`, with this folder
on PYTHONPATH), for the stage-boundary tests.

Eight layers of equal parameter count (a Linear and a position Embedding each), so the split is even: pp=2 cuts
after layer 3, pp=4 after layers 1, 3 and 5. What crosses each cut:
  after 1: a tuple (h float, gate float that carries a gradient, pos int64 of shape (seq,))
  after 3: a dict {"h": float, "pos": the int64 it received, handed on unchanged}
  after 5: a tuple (h float, mask bf16 made from pos: floating, but no gradient flows into it)
Every integer leaf feeds an embedding lookup, so a leaf that arrives wrong changes the losses and parameters.
"""

from __future__ import annotations

import torch
from torch import nn

POSITIONS = 64  # the longest --seq the model takes


class Layer(nn.Module):
    """The parameters every layer holds, and its residual update of h."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.pos = nn.Embedding(POSITIONS, hidden)

    def update(self, h: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        step = torch.tanh(self.lin(h))
        return h + (step if scale is None else step * scale) + self.pos(pos)


def positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[-2], device=h.device)


class Start(Layer):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = positions(x)
        h = self.update(x, pos)
        return h, torch.sigmoid(h[..., :1]), pos


class TupleMix(Layer):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, gate, pos = x
        h = self.update(h, pos, gate)
        return h, torch.sigmoid(gate + h[..., :1]), pos


class ToDict(Layer):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, gate, pos = x
        return {"h": self.update(h, pos, gate), "pos": pos}


class DictMix(Layer):
    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": self.update(x["h"], x["pos"]), "pos": x["pos"]}


class ToMasked(Layer):
    def forward(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.update(x["h"], x["pos"])
        mask = (x["pos"] % 3 != 0).to(torch.bfloat16)[None, :, None].expand(h.shape[0], -1, 1).contiguous()
        return h, mask


class MaskedMix(Layer):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        return self.update(h, positions(h), mask.float()), mask


class Merge(Layer):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = x
        return self.update(h, positions(h), 1 + mask.float())


class Finish(Layer):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.update(h, positions(h))


def build(hidden: int = 32) -> nn.Sequential:
    """The eight layers; the input is floats of width `hidden`, the output too (scored by MSE)."""
    return nn.Sequential(*(cls(hidden) for cls in (Start, TupleMix, ToDict, DictMix, ToMasked, MaskedMix, Merge,
                                                   Finish)))


class HandsOnAnInt(nn.Module):
    """A layer whose output holds a Python int: no stage boundary can carry it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x), 3


def bad_boundary(hidden: int = 32) -> nn.Sequential:
    """Split 1 + 1 at pp=2: stage 0 hands on (tensor, int)."""
    return nn.Sequential(HandsOnAnInt(hidden), Finish(hidden))
