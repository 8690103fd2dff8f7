"""The chunked cross-entropy (kernels/cross_entropy.py) against F.cross_entropy on float64 copies: loss and logit
gradient, several chunks (a last one shorter), the gradient in the logits' own dtype."""

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels.cross_entropy import ChunkedCrossEntropy, cross_entropy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab,chunk_rows", [(37, 50, 8), (64, 1000, 64), (5, 7, 1)])
def test_chunked_matches_float64(dtype, rows, vocab, chunk_rows):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    ref_in = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target)
    ref.backward(torch.tensor(0.7, dtype=torch.float64))
    loss = ChunkedCrossEntropy.apply(logits, target, chunk_rows)
    loss.backward(torch.tensor(0.7))
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    # the gradient is rounded once to the logits' dtype
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, rtol=tol, atol=tol * ref_in.grad.abs().max().item())


def test_fp32_logits_keep_torchs_loss():
    logits = torch.randn(3, 4, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 4))
    assert torch.equal(cross_entropy(logits, target), F.cross_entropy(logits.flatten(0, 1), target.flatten()))


def test_bf16_logits_take_chunks_sized_by_the_vocabulary():
    logits = torch.randn(2, 6, 40).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, 40, (2, 6))
    got = cross_entropy(logits, target, chunk_elements=80)  # two rows a chunk
    want = F.cross_entropy(logits.detach().double().flatten(0, 1), target.flatten())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got.backward()
    assert logits.grad.shape == logits.shape and torch.isfinite(logits.grad.float()).all()
