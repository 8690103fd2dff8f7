"""What the GPT costs: forward FLOPs per layer (to balance a stage split), model FLOPs per trained token and the
cards' bf16 peaks (for MFU).

Notation: L blocks, H hidden, T sequence, V vocabulary. A block's matmuls hold 12 H^2 weights (qkv 3 H^2, output
projection H^2, fc1 4 H^2, fc2 4 H^2); the head holds H V.
"""

from __future__ import annotations

import re


def gpt_layer_costs(*, vocab: int, hidden: int, layers: int, seq: int) -> list[float]:
    """Relative forward FLOPs per token of each of the layers + 2 layers (embedding, blocks, head).

    A block: 2 x 12 H^2 for its matmuls plus 2 T H for causal attention (QK^T and AV each 2 T H for a full
    T x T score matrix; a causal kernel computes about half of it). The head: 2 H V. The embedding is a gather
    with no matmul: it counts H, so it is never free."""
    block = 2 * 12 * hidden * hidden + 2 * seq * hidden
    return [float(hidden)] + [float(block)] * layers + [float(2 * hidden * vocab)]


def gpt_matmul_params(*, vocab: int, hidden: int, layers: int) -> int:
    """Weights that take part in matmuls: 12 H^2 per block and the head's H V (the embedding is a lookup)."""
    return 12 * layers * hidden * hidden + hidden * vocab


def gpt_flops_per_token(*, vocab: int, hidden: int, layers: int, seq: int) -> float:
    """Model FLOPs of one trained token (forward and backward, no recomputation): 6 N + 12 L H T, N the matmul
    weights of gpt_matmul_params.

    The formula of PaLM (Chowdhery et al., appendix B) that nanoGPT's estimate_mfu uses; it equals Megatron-LM's
    72 B T L H^2 (1 + T / 6H + V / 12LH) per B T tokens (Narayanan et al., without recomputation). Attention
    counts the full T x T scores, as both do, so MFU compares with their reports."""
    return 6.0 * gpt_matmul_params(vocab=vocab, hidden=hidden, layers=layers) + 12.0 * layers * hidden * seq


# Dense (no structured sparsity) bf16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets (H100, H200, A100),
# which quote the sparse figure, twice these. The first matching pattern wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bh100\b.*\bpcie\b", 756.5),
    (r"\bh100\b(?!.*\bnvl\b)", 989.4),  # H100 SXM5 (torch names it "NVIDIA H100 80GB HBM3")
    (r"\bh200\b(?!.*\bnvl\b)", 989.4),  # H200 SXM
    (r"\ba100\b", 312.0),  # A100 SXM4 and PCIe
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a card named as torch.cuda.get_device_name() names it; None when not in the table
    (MFU is then not reported)."""
    name = device_name.lower()
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops
    return None
