"""User models for the GPT tests (`--model lm_models:<factory>`, with this folder on PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn


class LastDim(nn.Module):
    """A Linear over the last dimension followed by tanh: one body layer of the tiny LM."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def embedding_lm(vocab_size: int, hidden: int) -> nn.Sequential:
    """nn.Embedding first, then two body layers, then logits over the vocabulary: a whole nn.Sequential."""
    return nn.Sequential(nn.Embedding(vocab_size, hidden), LastDim(hidden), LastDim(hidden),
                         nn.Linear(hidden, vocab_size))


def embedding_lm_builders(vocab_size: int, hidden: int) -> list:
    """The same layers as per-layer builders: each rank builds only its own."""
    return [lambda: nn.Embedding(vocab_size, hidden), lambda: LastDim(hidden), lambda: LastDim(hidden),
            lambda: nn.Linear(hidden, vocab_size)]


def deep_embedding_lm(vocab_size: int, hidden: int, layers: int) -> nn.Sequential:
    """embedding_lm with `layers` body layers (--layers): enough layers for eight stages at --layers 6."""
    return nn.Sequential(nn.Embedding(vocab_size, hidden), *(LastDim(hidden) for _ in range(layers)),
                         nn.Linear(hidden, vocab_size))


def float_lm(vocab_size: int) -> nn.Sequential:
    """A model whose first layer is a Linear of width 48: token ids (int64) do not fit it."""
    return nn.Sequential(nn.Linear(48, 48), nn.Linear(48, vocab_size))


def dropout_lm(vocab_size: int) -> nn.Sequential:
    """An embedding LM with dropout (for the notice); it ignores --hidden and --layers."""
    return nn.Sequential(nn.Embedding(vocab_size, 16), nn.Dropout(0.1), nn.Linear(16, vocab_size))


class FusedMlp(nn.Module):
    """A residual MLP whose Linears are peerline's FusedLinear on its own autograd path (impl "peerline", the path a
    GPU run takes): a zero-bubble B on it takes split_backward's lean form."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        from peerline.kernels.fused_linear import FusedLinear

        self.norm = nn.LayerNorm(hidden)
        self.fc1 = FusedLinear(hidden, 4 * hidden, bias=False, impl="peerline")
        self.fc2 = FusedLinear(4 * hidden, hidden, impl="peerline")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def fused_mlp_lm(vocab_size: int, hidden: int) -> nn.Sequential:
    """nn.Embedding, four FusedMlp blocks, a plain Linear head."""
    return nn.Sequential(nn.Embedding(vocab_size, hidden), *(FusedMlp(hidden) for _ in range(4)),
                         nn.Linear(hidden, vocab_size))
