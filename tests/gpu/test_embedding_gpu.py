"""The token embedding's weight-gradient kernel (kernels/embedding.cu) on a GPU against a float64 scatter-add of the
same gradient rows: repeated ids, ids a batch lacks (zero rows), a vocabulary that is not a multiple of the block's
rows, a width that is not a multiple of the block's column tile; poisoned outputs, bitwise repeatable, replayed
from a CUDA graph, and the Function's gradient against torch's embedding backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels.embedding import embedding, embedding_backward, kernel_takes

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _reference(ids: torch.Tensor, grad: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab, grad.shape[1], dtype=torch.float64, device=grad.device).index_add_(0, ids, grad.double())


@pytest.mark.parametrize("vocab,tokens,hidden", [(4096, 4096, 4096), (1001, 3000, 2056), (50, 700, 8)])
def test_gradient_matches_float64_into_a_poisoned_output(vocab: int, tokens: int, hidden: int) -> None:
    ids = torch.randint(0, vocab // 2, (tokens,), device="cuda")  # half the rows absent: they must come out 0
    grad = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    assert kernel_takes(torch.empty(vocab, hidden, dtype=torch.bfloat16), tokens)
    out = torch.full((vocab, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = embedding_backward(ids, grad, vocab, out=out)
    again = embedding_backward(ids, grad, vocab)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, again)
    want = _reference(ids, grad, vocab)
    assert torch.equal(got[vocab // 2:], torch.zeros_like(got[vocab // 2:]))
    # fp32 sums rounded once to bf16: within 2^-8 of each row's scale
    scale = want.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    assert ((got.double() - want).abs() <= scale * 2 ** -8).all()


def test_function_gradient_and_graph_replay() -> None:
    vocab, hidden = 4096, 1024
    weight = (torch.randn(vocab, hidden, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, vocab, (2, 2048), device="cuda")
    grad = torch.randn(2, 2048, hidden, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (the kernel compiles on first use)
            weight.grad = None
            embedding(ids, weight).backward(grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    weight.grad = torch.zeros_like(weight)
    with torch.cuda.graph(graph):
        embedding(ids, weight).backward(grad)
    for _ in range(2):
        ids.copy_(torch.randint(0, vocab, ids.shape, device="cuda"))
        grad.copy_(torch.randn_like(grad, dtype=torch.float32).to(torch.bfloat16))
        weight.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = weight.detach().clone().requires_grad_(True)
        F.embedding(ids, ref).backward(grad)  # torch's sort-based backward: the same sums in another order
        want = _reference(ids.reshape(-1), grad.reshape(-1, hidden), vocab)
        scale = want.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        assert ((weight.grad.double() - want).abs() <= scale * 2 ** -8).all()
        assert ((weight.grad.double() - ref.grad.double()).abs() <= scale * 2 ** -7).all()
