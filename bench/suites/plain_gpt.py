"""A GPT written the way a PyTorch user writes one, for the gpt suite's anchor: nn.Embedding, nn.Linear,
nn.LayerNorm, F.scaled_dot_product_attention and torchtitan's RoPE, and nothing of peerline's models or kernels.

It is --model gpt's architecture, so it has the same parameters and FLOPs per token (tests/unit/test_plain_gpt.py
counts both):

  layer 0         tok_embeddings  nn.Embedding(vocab, hidden)
  layers 1 .. L   TransformerBlock   x + proj(attention(rope(qkv(attention_norm(x)))))        qkv, proj: no bias
                                     x + fc2(gelu(fc1(ffn_norm(x))))       fc1 [h, 4h], fc2 [4h, h]: biases; exact GELU
  layer L + 1     norm, output    final LayerNorm and nn.Linear(hidden, vocab, bias=False) (tied to the embedding
                                  on request, when one module holds both)

The layout is torchtitan's (torchtitan/models/llama3/model.py): RoPE's table `freqs_cis` is complex64 [T, head_dim / 2],
computed once per module as a buffer and passed to every block; q and k are viewed as complex pairs (dimensions 2i,
2i + 1) in fp32, multiplied, viewed back as real and cast to their dtype. peerline's GPT pairs i with i + head_dim / 2
(rotate-half): the same rotation of a permuted q and k, so the same FLOPs and, with the q / k weights' rows
permuted, the same function (the unit test checks it). `compile_blocks` is torchtitan's apply_compile: each
TransformerBlock wrapped in torch.compile(fullgraph=True).

One module holds a contiguous range [start, stop) of the L + 2 layers, so a pipeline stage is `PlainGPT(...,
start=a, stop=b)`, as torchtitan's pipeline split keeps a stage's layers of the whole model. Every layer is
initialised from its own generator (GPT-2's init: N(0, 0.02), the two projections into the residual stream scaled by
1 / sqrt(2 L), zero biases), so any split starts from the weights of the whole model.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ROPE_THETA = 10_000.0
INIT_STD = 0.02


def precompute_freqs_cis(head_dim: int, end: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """e^(i t f_j) for positions t < end and frequencies f_j = theta^(-2j / head_dim): complex64 [end, head_dim / 2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, T, heads, head_dim] rotated pairwise by freqs_cis (its first T rows), in fp32; returned in their
    dtype."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on q and k."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, hidden = x.shape
        xq, xk, xv = self.qkv(x).view(bs, seqlen, 3, self.heads, self.head_dim).unbind(dim=2)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        y = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(bs, seqlen, hidden))


class FeedForward(nn.Module):
    """fc2(gelu(fc1(x))), exact (erf) GELU."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP, each added back to the residual stream."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.ffn_norm = nn.LayerNorm(hidden)
        self.feed_forward = FeedForward(hidden)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class PlainGPT(nn.Module):
    """Layers [start, stop) of the GPT's layers + 2 (0: embedding, 1 .. layers: blocks, layers + 1: head).

    Blocks are kept under their block number (`layers["0"]` is layer 1), as torchtitan keeps a pipeline stage's
    blocks under their names in the whole model."""

    def __init__(self, *, vocab: int, hidden: int, heads: int, layers: int, seq: int, start: int = 0,
                 stop: int | None = None, seed: int = 0, tie_embeddings: bool = False) -> None:
        super().__init__()
        stop = layers + 2 if stop is None else stop
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError(f"hidden {hidden} must split into {heads} heads of an even width")
        if not 0 <= start < stop <= layers + 2:
            raise ValueError(f"layer range [{start}, {stop}) is not inside the model's {layers + 2} layers")
        self.head_dim, self.seq = hidden // heads, seq
        self.tok_embeddings = nn.Embedding(vocab, hidden) if start == 0 else None
        self.layers = nn.ModuleDict({str(i - 1): TransformerBlock(hidden, heads)
                                     for i in range(max(start, 1), min(stop, layers + 1))})
        self.norm = nn.LayerNorm(hidden) if stop == layers + 2 else None
        self.output = nn.Linear(hidden, vocab, bias=False) if stop == layers + 2 else None
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, seq) if self.layers else None,
                             persistent=False)
        self.init_weights(seed, layers)
        if tie_embeddings:
            if self.tok_embeddings is None or self.output is None:
                raise ValueError("tied embeddings need the embedding and the head in one module")
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int, layers: int) -> None:
        """GPT-2's init, each layer from its own generator (seeded by the seed and the layer's index)."""
        out_std = INIT_STD / math.sqrt(2 * layers)

        def gen(index: int) -> torch.Generator:
            return torch.Generator().manual_seed(seed * 10_007 + index)

        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD, generator=gen(0))
        for name, block in self.layers.items():
            g = gen(int(name) + 1)
            for linear, std in ((block.attention.qkv, INIT_STD), (block.attention.proj, out_std),
                                (block.feed_forward.fc1, INIT_STD), (block.feed_forward.fc2, out_std)):
                nn.init.normal_(linear.weight, std=std, generator=g)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=INIT_STD, generator=gen(layers + 1))

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # Module.to(dtype) casts complex buffers too (to a real dtype: the imaginary part dropped); the RoPE table
        # stays complex64 and only follows the module's device.
        table = self._buffers.pop("freqs_cis", None)
        super()._apply(fn, recurse)
        if table is not None:
            table = table.to(fn(torch.empty(0, device=table.device)).device)
        self.register_buffer("freqs_cis", table, persistent=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)) if self.output is not None else h


def compile_blocks(model: PlainGPT, backend: str = "inductor") -> PlainGPT:
    """torchtitan's apply_compile: every TransformerBlock replaced by torch.compile(block, fullgraph=True) (a graph
    break raises instead of running part of the block eagerly). In place; returns the model."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))
    return model


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of logits [B, T, V] against labels [B, T] in fp32, mean over the tokens."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


__all__ = ["PlainGPT", "TransformerBlock", "Attention", "FeedForward", "precompute_freqs_cis", "apply_rotary_emb",
           "compile_blocks", "cross_entropy_loss"]
