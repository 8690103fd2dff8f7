"""The cross-entropy of bf16 logits on a GPU against float64 torch: the fused kernels (cross_entropy.cu) and the
chunked torch path, eager and replayed from a CUDA graph, with poisoned outputs, row-strided logits and bad labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_forward,
    fused_supported,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _reference(logits: torch.Tensor, target: torch.Tensor, grad: float = 1.0) -> tuple[float, torch.Tensor]:
    ref_in = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target)
    ref.backward(torch.tensor(grad, dtype=torch.float64, device=logits.device))
    return ref.item(), ref_in.grad


def _check(loss: float, grad: torch.Tensor, ref: float, ref_grad: torch.Tensor) -> None:
    assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
    err = ((grad.double() - ref_grad).norm() / ref_grad.norm()).item()
    assert err < 8e-3, err  # one bf16 rounding of each element
    assert ((grad.double() - ref_grad).abs() <= 8e-3 * ref_grad.abs() + 1e-3 * ref_grad.abs().max()).all()


@pytest.mark.parametrize("impl", ["auto", "torch"], ids=["fused", "chunked"])
@pytest.mark.parametrize("rows,vocab", [(2048, 4096), (1001, 4096), (1024, 128256), (37, 8)])
def test_loss_and_gradient_match_float64(rows: int, vocab: int, impl: str) -> None:
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    assert fused_supported(logits)
    loss = cross_entropy(logits, target, chunk_elements=1 << 22, impl=impl)
    loss.backward(torch.tensor(0.7, device="cuda"))
    _check(loss.item(), logits.grad, *_reference(logits, target, 0.7))


def test_kernels_write_every_element_of_poisoned_outputs_and_repeat_bitwise() -> None:
    """The backward's output starts as NaN: every element is written. Row-strided logits (a view of wider rows)
    read only their own columns. Two runs give the same bits."""
    rows, vocab = 777, 4096
    wide = (torch.randn(rows, vocab + 64, device="cuda") * 3).to(torch.bfloat16)
    wide[:, vocab:] = float("nan")  # columns past the view: read, they would poison every row
    logits = wide[:, :vocab]
    target = torch.randint(0, vocab, (rows,), device="cuda")
    assert fused_supported(logits) and not logits.is_contiguous()
    grad_loss = torch.tensor(1.3, device="cuda")
    runs = []
    for _ in range(2):
        lse, per_row = cross_entropy_forward(logits, target)
        out = torch.full((rows, vocab), float("nan"), dtype=torch.bfloat16, device="cuda")
        runs.append((per_row, cross_entropy_backward(logits, target, lse, grad_loss, out=out)))
    (loss_a, grad_a), (loss_b, grad_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert torch.isfinite(grad_a.float()).all()
    _check(loss_a.mean().item(), grad_a, *_reference(logits, target, 1.3))


def test_a_label_out_of_range_makes_its_row_nan() -> None:
    rows, vocab = 64, 512
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[5], target[9] = vocab, -1
    lse, per_row = cross_entropy_forward(logits, target)
    grad = cross_entropy_backward(logits, target, lse, torch.ones((), device="cuda"))
    bad = torch.zeros(rows, dtype=torch.bool, device="cuda")
    bad[[5, 9]] = True
    assert torch.isnan(per_row[bad]).all() and torch.isfinite(per_row[~bad]).all()
    assert torch.isnan(grad[bad].float()).all() and torch.isfinite(grad[~bad].float()).all()


@pytest.mark.parametrize("impl", ["auto", "torch"], ids=["fused", "chunked"])
def test_loss_replays_in_a_graph(impl: str) -> None:
    rows, vocab = 512, 32000
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (the kernels compile on first use)
            logits.grad = None
            cross_entropy(logits, target, impl=impl).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    logits.grad = torch.zeros_like(logits)  # the backward accumulates into it: zeroed before each replay
    with torch.cuda.graph(graph):
        loss = cross_entropy(logits, target, impl=impl)
        loss.backward()
    for _ in range(2):
        new = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            logits.copy_(new)
            logits.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _check(loss.item(), logits.grad, *_reference(new, target))
