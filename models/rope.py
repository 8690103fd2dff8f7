"""Rotary position embeddings (RoPE, Su et al.): positions enter attention by rotating q and k, so no layer
learns a position table and a pipeline boundary carries nothing but the hidden states.

The rotate-half layout of GPT-NeoX and Llama: dimension i pairs with i + head_dim / 2. The rotation itself
(apply_rope, and the fused attention path) lives in kernels/rope.py.
"""

from __future__ import annotations

import torch

from peerline.kernels.rope import apply_rope

__all__ = ["ROPE_BASE", "apply_rope", "rope_tables"]

ROPE_BASE = 10_000.0


def rope_tables(max_seq: int, head_dim: int, base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, dimension) angle, each [max_seq, head_dim] in fp32 (computed in fp64 so
    the tables are the same on every machine)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()
