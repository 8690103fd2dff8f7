"""The chunked cross-entropy on a GPU (bf16 logits of a large vocabulary) against float64 torch, eager and replayed
from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels.cross_entropy import cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("rows,vocab", [(2048, 4096), (1024, 128256)])
def test_chunked_loss_matches_float64(rows: int, vocab: int) -> None:
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    ref_in = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target)
    ref.backward()
    loss = cross_entropy(logits, target, chunk_elements=1 << 22)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    err = ((logits.grad.double() - ref_in.grad).norm() / ref_in.grad.norm()).item()
    assert err < 8e-3, err


def test_chunked_loss_replays_in_a_graph() -> None:
    rows, vocab = 512, 32000
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture
            logits.grad = None
            cross_entropy(logits, target).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    logits.grad = torch.zeros_like(logits)  # the backward accumulates into it: zeroed before each replay
    with torch.cuda.graph(graph):
        loss = cross_entropy(logits, target)
        loss.backward()
    new = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        logits.copy_(new)
        logits.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref_in = new.double().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    err = ((logits.grad.double() - ref_in.grad).norm() / ref_in.grad.norm()).item()
    assert err < 8e-3, err
