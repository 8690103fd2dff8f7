"""The token embedding's kernel path (kernels/embedding.py) on the CPU: its autograd Function (torch's backward in
the kernel's place) against F.embedding, which shapes the kernel takes, the routing, and the launch's packing
against the kernel's declared parameters. tests/gpu/test_embedding_gpu.py checks the kernel itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels import embedding as emb
from tests.unit.kernel_host import declared_kinds, record_launches


def _fresh(vocab: int, hidden: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    return torch.randint(0, vocab, shape, generator=gen), weight


def test_function_matches_f_embedding() -> None:
    ids, weight = _fresh(50, 16, (3, 40))  # ids repeat: rows sum several gradients
    ours, ref = weight.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    grad = torch.randn(3, 40, 16).to(torch.bfloat16)
    out = emb.KernelEmbedding.apply(ids, ours)
    assert torch.equal(out, F.embedding(ids, ref))
    out.backward(grad)
    F.embedding(ids, ref).backward(grad)
    assert ours.grad.shape == (50, 16) and torch.equal(ours.grad, ref.grad)


def test_kernel_takes_bf16_rows_of_whole_vectors_up_to_the_scan_limit() -> None:
    assert emb.kernel_takes(torch.zeros(4096, 4096, dtype=torch.bfloat16), 4096)
    assert not emb.kernel_takes(torch.zeros(64, 12, dtype=torch.bfloat16), 10)  # H not a multiple of 8
    assert not emb.kernel_takes(torch.zeros(64, 16), 10)  # fp32
    assert emb.kernel_takes(torch.zeros(1 << 10, 8, dtype=torch.bfloat16), emb.SCAN_LIMIT >> 10)
    assert not emb.kernel_takes(torch.zeros(1 << 10, 8, dtype=torch.bfloat16), (emb.SCAN_LIMIT >> 10) + 1)


def test_route(monkeypatch: pytest.MonkeyPatch) -> None:
    routes: list[str] = []
    monkeypatch.setattr(emb, "_on_device", lambda t: True)  # the CPU weight passes as a GPU one
    monkeypatch.setattr(emb.KernelEmbedding, "apply", lambda *a: routes.append("kernel") or torch.zeros(()))
    ids, weight = _fresh(64, 16, (2, 8))
    weight.requires_grad_(True)
    emb.embedding(ids, weight)
    emb.embedding(ids, weight, impl="torch")
    emb.embedding(ids, weight.detach())  # no gradient to compute
    emb.embedding(ids, weight.detach().float().requires_grad_(True))
    assert routes == ["kernel"]


def test_launch_packs_the_kernels_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = record_launches(monkeypatch)
    monkeypatch.setattr(emb, "_on_device", lambda t: True)
    ids, _ = _fresh(100, 24, (37,))
    emb.embedding_backward(ids, torch.zeros(37, 24, dtype=torch.bfloat16), 100)
    ((name, kinds, values),) = recorded
    assert name == "pl_embedding_backward"
    assert kinds == declared_kinds(emb.KERNEL_SOURCE.read_text(), name)
    assert values[-3:] == (37, 100, 24)  # tokens, vocab, hidden
