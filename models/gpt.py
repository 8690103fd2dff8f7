"""A decoder-only transformer language model, built as a flat list of layers so a stage split can cut it anywhere.

  index 0        TokenEmbedding   int64 ids [B, T] -> hidden states [B, T, H]
  index 1 .. L   GPTBlock         pre-norm causal self-attention (RoPE fused on the packed qkv with flash attention,
                                  kernels/rope.py; unfused on the CPU)
                                  and an MLP (fc1 -> bias+GELU -> fc2), both added back to the residual stream
  index L + 1    LMHead           final LayerNorm and the projection to the vocabulary: logits [B, T, V] in the
                                  compute dtype (the loss upcasts them a chunk at a time, kernels/cross_entropy.py)

Positions come from RoPE inside attention, so every boundary between layers carries one tensor, [B, T, H].
The Linears are FusedLinear, the LayerNorms FusedLayerNorm (bf16 kernels, kernels/layer_norm.py; each block's
two norms take the residual's gradient in their backward, the second also fc2's bias gradient), and the
bias+GELU and residual adds go through peerline.kernels.ops, as in the residual-MLP model. Every layer is
initialised under its own seed (distributed/model.py's layer_seed), so any split builds the weights the
single-process model has.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError
from peerline.distributed.model import layer_seed
from peerline.kernels import ops
from peerline.kernels.embedding import embedding
from peerline.kernels.fused_linear import FusedLinear
from peerline.kernels.layer_norm import FusedLayerNorm
from peerline.kernels.rope import attention_backend, rope_attention
from peerline.models.rope import rope_tables

INIT_STD = 0.02  # GPT-2's initialisation: N(0, 0.02) weights, zero biases


def embedding_init(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """The token embedding's initial weight [vocab, hidden], drawn from the embedding layer's own seed (layer 0)
    by a private generator: a head tied to the embedding starts from the same tensor on any stage."""
    generator = torch.Generator().manual_seed(layer_seed(seed, 0))
    return torch.randn(vocab, hidden, generator=generator) * INIT_STD


class TokenEmbedding(nn.Module):
    """Token ids (int64 [B, T]) -> their embedding vectors [B, T, H]; with `kernels` other than "torch", the weight
    gradient of a bf16 weight on a GPU through kernels/embedding.py where its kernel takes the shape."""

    def __init__(self, vocab: int, hidden: int, kernels: str = "torch", *, seed: int = 0) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight = nn.Parameter(embedding_init(vocab, hidden, seed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.dim() != 2:
            raise TypeError(f"TokenEmbedding takes integer token ids [batch, seq]; got {ids.dtype} "
                            f"{list(ids.shape)}")
        return embedding(ids, self.weight, self.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class GPTBlock(nn.Module):
    """x + attn(norm1(x)), then + fc2(gelu(fc1(norm2(x)) + b1)): pre-norm causal self-attention and an MLP.

    `max_seq` sizes the RoPE tables (non-persistent buffers: derived, not state); `depth` (the number of blocks)
    scales the init of the two projections that write into the residual stream by 1/sqrt(2 * depth), as GPT-2
    does. fc1 has no bias of its own: its bias is fused into the GELU kernel."""

    def __init__(self, hidden: int, heads: int, kernels: str = "torch", *, max_seq: int = 2048,
                 depth: int = 1) -> None:
        super().__init__()
        check_shape(hidden, heads)
        self.heads, self.head_dim, self.kernels = heads, hidden // heads, kernels
        self.attention_impl = attention_backend()  # read once: a bad PEERLINE_ATTENTION fails while the model is built
        self.norm1 = FusedLayerNorm(hidden, impl=kernels)
        self.qkv = FusedLinear(hidden, 3 * hidden, bias=False, impl=kernels)
        self.proj = FusedLinear(hidden, hidden, bias=False, impl=kernels)
        self.norm2 = FusedLayerNorm(hidden, impl=kernels)
        self.fc1 = FusedLinear(hidden, 4 * hidden, bias=False, impl=kernels)
        self.fc1_bias = nn.Parameter(torch.zeros(4 * hidden))
        self.fc2 = FusedLinear(4 * hidden, hidden, impl=kernels)
        cos, sin = rope_tables(max_seq, self.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        out_std = INIT_STD / math.sqrt(2 * depth)
        for linear, std in ((self.qkv, INIT_STD), (self.proj, out_std), (self.fc1, INIT_STD), (self.fc2, out_std)):
            nn.init.normal_(linear.weight, std=std)
        nn.init.zeros_(self.fc2.bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention of x [B, T, H] (already normalised), projected back to [B, T, H]."""
        seq = x.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {seq} tokens is longer than the block's max_seq {self.rope_cos.shape[0]}")
        y = rope_attention(self.qkv(x), self.rope_cos, self.rope_sin, self.heads, self.kernels,
                           self.attention_impl)
        return self.proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, residual, _ = self.norm1.with_residual(x)
        x = ops.residual_add(residual, self.attention(n), self.kernels)
        return ops.pre_norm_mlp(x, self.norm2, self.fc1, self.fc1_bias, self.fc2, self.kernels)


class LMHead(nn.Module):
    """Final LayerNorm and the projection to the vocabulary: [B, T, H] -> logits [B, T, V] (compute dtype).

    tied=True starts the projection's weight as a copy of the embedding's initial weight (embedding_init of the
    same seed), so a head on another stage starts equal to the embedding; summing the two weights' gradients
    across stages keeps them equal and is the pipeline's job."""

    def __init__(self, hidden: int, vocab: int, kernels: str = "torch", *, tied: bool = False, seed: int = 0
                 ) -> None:
        super().__init__()
        self.tied = tied
        self.norm = FusedLayerNorm(hidden, impl=kernels)
        self.out = FusedLinear(hidden, vocab, bias=False, impl=kernels)
        with torch.no_grad():
            if tied:
                self.out.weight.copy_(embedding_init(vocab, hidden, seed))
            else:
                nn.init.normal_(self.out.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))  # compute-dtype logits: the loss reads bf16 ones in chunks, in fp32


def check_shape(hidden: int, heads: int) -> None:
    """hidden must split into `heads` heads of an even width (RoPE rotates dimension pairs)."""
    if heads < 1 or hidden % heads:
        raise ConfigError(f"--hidden {hidden} is not divisible by --heads {heads}")
    if (hidden // heads) % 2:
        raise ConfigError(f"head width {hidden // heads} (--hidden / --heads) must be even for RoPE")


def build_gpt_layers(*, vocab: int, hidden: int, heads: int, layers: int, seq: int, seed: int, kernels: str,
                     start: int = 0, stop: int | None = None, tie_embeddings: bool = False) -> list[nn.Module]:
    """Layers [start, stop) of the layers + 2 of the GPT (0 = embedding, 1..layers = blocks, layers + 1 = head),
    each built on the CPU under its own seed, so any split builds the same weights."""
    total = layers + 2
    stop = total if stop is None else stop
    if not 0 <= start < stop <= total:
        raise ConfigError(f"GPT layer range [{start}, {stop}) is not inside the model's {total} layers")
    check_shape(hidden, heads)
    built: list[nn.Module] = []
    for index in range(start, stop):
        torch.manual_seed(layer_seed(seed, index))
        if index == 0:
            built.append(TokenEmbedding(vocab, hidden, kernels, seed=seed))
        elif index == total - 1:
            built.append(LMHead(hidden, vocab, kernels, tied=tie_embeddings, seed=seed))
        else:
            built.append(GPTBlock(hidden, heads, kernels, max_seq=seq, depth=layers))
    return built


def describe_gpt_split(bounds: list[tuple[int, int]], layers: int) -> str:
    """Each stage's part of the GPT by name, for the start line: layer 0 is the token embedding, layers
    1..`layers` the blocks (numbered from 0 here, as --layers counts them), layer `layers` + 1 the LM head."""
    parts = []
    for s, (a, b) in enumerate(bounds):
        held = ["embedding"] if a == 0 else []
        first, last = max(a, 1) - 1, min(b, layers + 1) - 2  # the blocks of layers [a, b)
        if last >= first:
            held.append(f"block {first}" if first == last else f"blocks {first}-{last}")
        if b == layers + 2:
            held.append("LM head")
        parts.append(f"stage {s}: {', '.join(held)}")
    return "; ".join(parts)
