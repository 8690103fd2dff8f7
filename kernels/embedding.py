"""The token embedding with its weight gradient in one kernel (embedding.cu) where that beats torch's.

torch's embedding backward sorts the ids (a radix sort of several launches), sums each id's rows into partial
buffers and scatters them: about ten kernels per microbatch. For a vocabulary of V rows and a microbatch of N tokens
with V x N at most SCAN_LIMIT, embedding.cu writes the whole [V, H] gradient in one launch instead: each block scans
the ids for its own rows and sums their gradient rows in token order (fp32 sums, bf16 out, repeatable). Its scan
reads the ids once per block, so past SCAN_LIMIT torch's sort is the cheaper way and torch's backward runs.

The kernel takes CUDA bf16 weights with H % 8 == 0 (16-byte vectors); everything else, the CPU and --kernels torch
run torch's embedding backward. The forward is torch's gather either way. On the CPU the Function runs with torch's
backward in the kernel's place, so CI checks its autograd contract; tests/gpu/test_embedding_gpu.py checks the kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

KERNEL_SOURCE = Path(__file__).resolve().parent / "embedding.cu"
# V x tokens up to which the kernel's scan costs less than torch's sort. Measured on an H200 (H 4096,
# tools/gpu_probes/embedding_probe.py): 4096 x 4096 0.151 ms against torch's 0.284, 4096 x 8192 0.291 against
# 0.350, 16384 x 4096 0.542 against 0.353.
SCAN_LIMIT = 1 << 25
_THREADS = 256  # embedding.cu's PL_EMB_THREADS
_ROWS = 4  # PL_EMB_ROWS: vocabulary rows a block owns


def kernel_takes(weight: torch.Tensor, tokens: int) -> bool:
    """Whether the kernel computes this weight's gradient for `tokens` ids: bf16 [V, H], H % 8 == 0, V x tokens
    at most SCAN_LIMIT."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 8 == 0
            and weight.shape[0] * tokens <= SCAN_LIMIT)


def _on_device(t: torch.Tensor) -> bool:
    """Whether the kernel runs (a CUDA tensor) rather than torch's backward; the launch-packing test patches it."""
    return t.is_cuda


def embedding_backward(ids: torch.Tensor, grad: torch.Tensor, vocab: int, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The weight gradient [vocab, H] of an embedding lookup: `ids` int64 [N] (contiguous), `grad` [N, H]; through
    the kernel on a GPU (into `out` where given, as the tests poison it), torch's backward on the CPU."""
    if not _on_device(grad):
        return torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False)
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    tokens, hidden = grad.shape
    grad = grad.contiguous()
    if out is None:
        out = torch.empty(vocab, hidden, dtype=grad.dtype, device=grad.device)
    if not (out.is_contiguous() and out.shape == (vocab, hidden) and grad.data_ptr() % 16 == 0
            and out.data_ptr() % 16 == 0):
        raise ValueError("the embedding kernel reads and writes contiguous, 16-byte aligned bf16 [rows, H]")
    kernel, _ = load_kernel(KERNEL_SOURCE, "pl_embedding_backward", grad.device.index)
    blocks = -(-vocab // _ROWS) * -(-hidden // (8 * _THREADS))
    launch_raw(kernel, blocks, _THREADS, "pppqqi",
               (ids.data_ptr(), grad.data_ptr(), out.data_ptr(), tokens, vocab, hidden), grad.device)
    return out


class KernelEmbedding(torch.autograd.Function):
    """F.embedding(ids, weight) whose weight gradient is embedding_backward's."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.vocab = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        return None, embedding_backward(ids.reshape(-1).contiguous(), flat, ctx.vocab)


def embedding(ids: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """F.embedding(ids, weight), its weight gradient through the kernel where it takes it (kernel_takes, CUDA,
    `impl` not "torch"), torch's otherwise."""
    if impl != "torch" and _on_device(weight) and weight.requires_grad and kernel_takes(weight, ids.numel()):
        return KernelEmbedding.apply(ids, weight)
    return F.embedding(ids, weight)
