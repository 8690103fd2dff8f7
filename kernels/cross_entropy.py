"""Cross-entropy of low-precision logits without an fp32 copy of them (the chunked loss of Megatron-Core's and
Liger's fused cross-entropy, in torch ops).

`F.cross_entropy(logits.float(), target)` on bf16 logits [N, V] materialises fp32 logits (4 N V bytes) and an fp32
gradient of the same size. Here the forward reads the bf16 logits a chunk of rows at a time (each chunk upcast, its
log-sum-exp kept: 4 N bytes), and the backward writes softmax - one-hot straight into a bf16 gradient, chunk by
chunk: the peak extra memory is one fp32 chunk (CHUNK_ELEMENTS), whatever the vocabulary. The math is fp32 in both
directions, so the loss equals the fp32 reference's to fp32 rounding. No host synchronisation: capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per chunk


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits [N, V] (any float dtype) against int64 labels [N], fp32 result."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        rows = logits.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_rows):
            lse[start:start + chunk_rows] = torch.logsumexp(logits[start:start + chunk_rows].float(), dim=1)
        picked = logits.gather(1, target.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, target, lse)
        ctx.chunk_rows = chunk_rows
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        rows, step = logits.shape[0], ctx.chunk_rows
        scale = grad_loss.float() / rows
        grad = torch.empty_like(logits)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            prob = torch.exp(logits[start:stop].float() - lse[start:stop, None])
            prob.scatter_add_(1, target[start:stop, None], torch.full((stop - start, 1), -1.0, device=prob.device))
            grad[start:stop] = prob.mul_(scale)
        return grad, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Mean cross-entropy over the rows of logits [..., V] against labels [...], in fp32: torch's own for fp32
    logits, the chunked Function for lower precisions (no fp32 copy of the logits)."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return F.cross_entropy(flat, labels)
    return ChunkedCrossEntropy.apply(flat, labels, max(1, chunk_elements // flat.shape[1]))
