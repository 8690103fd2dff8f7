"""Cross-entropy of low-precision logits without an fp32 copy of them.

`F.cross_entropy(logits.float(), target)` on bf16 logits [N, V] materialises fp32 logits (4 N V bytes) and an fp32
gradient of the same size, through a dozen kernels. Two paths avoid that:

  fused    (CUDA bf16 logits the kernels take, `fused_supported`) cross_entropy.cu: the forward reads the logits once
           (online softmax: lse and the loss per row), the backward reads them once more and writes
           softmax - one-hot straight into a bf16 gradient, scaled by the loss's gradient read on the device. This is
           the structure of Transformer Engine's Triton cross-entropy (online softmax, the gradient in one pass),
           with the gradient written in the backward rather than over the logits in the forward, so a zero-bubble
           schedule's deferred backward reads the logits it keeps anyway.
  chunked  (everything else of lower precision: the CPU, --kernels torch, a vocabulary that is not a multiple of 8)
           the same math in torch ops, a chunk of rows at a time (the chunked loss of Megatron-Core and Liger): the
           peak extra memory is one fp32 chunk (CHUNK_ELEMENTS), whatever the vocabulary.

Both compute in fp32, so the loss equals the fp32 reference's to fp32 rounding. No host synchronisation: both are
capturable. On the CPU the fused Function runs with torch stand-ins for its two kernels, so CI checks its autograd
contract; tests/gpu/test_cross_entropy_gpu.py checks the kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per chunk
KERNEL_SOURCE = Path(__file__).resolve().parent / "cross_entropy.cu"
_THREADS = 256  # eight warps: eight rows a block pass (cross_entropy.cu)
_MAX_BLOCKS = 8192


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
            rows_here = slice(start, min(start + step, rows))
            grad[rows_here] = _gradient_rows(logits[rows_here], target[rows_here], lse[rows_here], scale)
        return grad, None, None


def _gradient_rows(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor
                   ) -> torch.Tensor:
    """(softmax - one-hot) x scale of logits [n, V] in fp32: the loss's gradient for these rows, in torch ops."""
    prob = torch.exp(logits.float() - lse[:, None])
    prob.scatter_add_(1, target[:, None], torch.full((logits.shape[0], 1), -1.0, device=prob.device))
    return prob.mul_(scale)


def kernel_layout_ok(logits: torch.Tensor) -> bool:
    """What cross_entropy.cu's 16-byte row reads assume of logits [N, V]: bf16, the last dimension dense, V a
    multiple of 8 below 2^31, every row 16-byte aligned (row stride a multiple of 8, the pointer of 16)."""
    return (logits.dim() == 2 and logits.dtype == torch.bfloat16 and logits.stride(1) == 1
            and logits.shape[1] % 8 == 0 and 0 < logits.shape[1] < 2 ** 31 and logits.stride(0) % 8 == 0
            and logits.data_ptr() % 16 == 0)


def fused_supported(logits: torch.Tensor) -> bool:
    """Whether the fused path takes logits [N, V]: CUDA, and the layout the kernels read (kernel_layout_ok)."""
    return logits.is_cuda and kernel_layout_ok(logits)


def _on_device(t: torch.Tensor) -> bool:
    """Whether the kernels run (a CUDA tensor) rather than the CPU stand-ins; the launch-packing test patches it."""
    return t.is_cuda


def _launch(name: str, kinds: str, values: tuple, rows: int, device: torch.device) -> None:
    """Launch kernel `name` of cross_entropy.cu with a warp per row (grid-stride past _MAX_BLOCKS blocks)."""
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    kernel, _ = load_kernel(KERNEL_SOURCE, name, device.index)
    launch_raw(kernel, max(1, min(-(-rows // (_THREADS // 32)), _MAX_BLOCKS)), _THREADS, kinds, values, device)


def cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, loss) per row [N] in fp32 of logits [N, V] and int64 labels [N] (contiguous)."""
    rows, vocab = logits.shape
    if not _on_device(logits):  # the stand-in of the CPU contract tests
        lse = torch.logsumexp(logits.float(), dim=1)
        return lse, lse - logits.gather(1, target.unsqueeze(1)).squeeze(1).float()
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    _launch("pl_ce_forward", "ppppqiq", (logits.data_ptr(), target.data_ptr(), lse.data_ptr(), loss.data_ptr(),
                                         rows, vocab, logits.stride(0)), rows, logits.device)
    return lse, loss


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient [N, V] of the mean loss, (softmax - one-hot) grad_loss / N, in the logits' dtype; into `out`
    (contiguous) where given, as the tests poison it. `grad_loss`: a one-element fp32 tensor."""
    rows, vocab = logits.shape
    if not _on_device(logits):  # the stand-in of the CPU contract tests
        grad = _gradient_rows(logits, target, lse, grad_loss.float() / rows).to(logits.dtype)
        return grad if out is None else out.copy_(grad)
    if out is None:
        out = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
    if not (out.is_contiguous() and out.shape == logits.shape and out.dtype == logits.dtype
            and out.data_ptr() % 16 == 0):
        raise ValueError("the fused cross-entropy writes its gradient into a contiguous, 16-byte aligned tensor "
                         "shaped and typed like the logits")
    _launch("pl_ce_backward", "pppppqiq", (logits.data_ptr(), target.data_ptr(), lse.data_ptr(),
                                           grad_loss.data_ptr(), out.data_ptr(), rows, vocab, logits.stride(0)),
            rows, logits.device)
    return out


class FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of bf16 logits [N, V] against int64 labels [N] through cross_entropy.cu, fp32 result."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        lse, loss = cross_entropy_forward(logits, target)
        ctx.save_for_backward(logits, target, lse)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        return cross_entropy_backward(logits, target, lse, grad_loss.float().contiguous()), None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS,
                  impl: str = "auto") -> torch.Tensor:
    """Mean cross-entropy over the rows of logits [..., V] against labels [...], in fp32: torch's own for fp32
    logits, the fused kernels where they take the logits and `impl` is not "torch", else the chunked Function."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return F.cross_entropy(flat, labels)
    if impl != "torch" and fused_supported(flat):
        return FusedCrossEntropy.apply(flat, labels.to(torch.int64).contiguous())
    return ChunkedCrossEntropy.apply(flat, labels, max(1, chunk_elements // flat.shape[1]))
