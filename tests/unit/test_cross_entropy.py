"""The cross-entropy of kernels/cross_entropy.py against F.cross_entropy on float64 copies: the chunked path (loss
and logit gradient, several chunks, a last one shorter, the gradient in the logits' own dtype), and the fused path's
contract on the CPU: its Function's autograd, the layouts its kernels take, the routing, the launches' packing."""

import pytest
import torch
import torch.nn.functional as F

from peerline.kernels import cross_entropy as ce
from peerline.kernels.cross_entropy import (
    ChunkedCrossEntropy,
    FusedCrossEntropy,
    cross_entropy,
    fused_supported,
    kernel_layout_ok,
)
from tests.unit.kernel_host import declared_kinds, record_launches


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


# ---- the fused path's contract on the CPU (its kernels' torch stand-ins; tests/gpu checks the kernels) ----

def _fresh(rows: int, vocab: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(torch.bfloat16)
    return logits, torch.randint(0, vocab, (rows,), generator=gen)


def test_fused_function_matches_float64() -> None:
    logits, target = _fresh(19, 64)
    logits.requires_grad_(True)
    ref_in = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_in, target)
    ref.backward(torch.tensor(0.7, dtype=torch.float64))
    loss = FusedCrossEntropy.apply(logits, target)
    loss.backward(torch.tensor(0.7))
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16 and logits.grad.shape == logits.shape
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, rtol=8e-3, atol=8e-3 * ref_in.grad.abs().max().item())


def test_kernel_layout_rules() -> None:
    """The kernels read 16-byte vectors of whole rows: bf16, V % 8 == 0, rows 16-byte aligned; anything else takes
    the chunked path."""
    holder = torch.zeros(4, 80, dtype=torch.bfloat16)
    assert holder.data_ptr() % 16 == 0
    assert kernel_layout_ok(holder[:, :64])  # a row stride of 80 elements (160 bytes)
    assert not kernel_layout_ok(holder[:, :60])  # V not a multiple of 8
    assert not kernel_layout_ok(holder[:, 4:68])  # rows start 8 bytes off
    assert not kernel_layout_ok(torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64])  # every other row misaligned
    assert not kernel_layout_ok(torch.zeros(4, 64, dtype=torch.float16))
    assert not kernel_layout_ok(torch.zeros(64, 4, dtype=torch.bfloat16).t())  # the last dimension strided
    assert not kernel_layout_ok(torch.zeros(4, 2, 64, dtype=torch.bfloat16))  # not [N, V]
    assert not fused_supported(holder[:, :64])  # a CPU tensor: never the kernels


def test_route_by_dtype_layout_and_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 logits the kernels take go through FusedCrossEntropy unless impl is "torch"; the rest are chunked."""
    routes: list[str] = []
    monkeypatch.setattr(ce, "fused_supported", kernel_layout_ok)  # the CPU tensors pass as if on a GPU
    monkeypatch.setattr(FusedCrossEntropy, "apply", lambda *a: routes.append("fused") or torch.zeros(()))
    monkeypatch.setattr(ChunkedCrossEntropy, "apply", lambda *a: routes.append("chunked") or torch.zeros(()))
    logits, target = _fresh(6, 32)
    cross_entropy(logits.view(2, 3, 32), target.view(2, 3))
    cross_entropy(logits, target, impl="torch")
    cross_entropy(logits[:, :30], target.clamp(max=29))
    assert routes == ["fused", "chunked", "chunked"]


def test_launches_pack_the_kernels_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = record_launches(monkeypatch)
    monkeypatch.setattr(ce, "_on_device", lambda t: True)
    logits, target = _fresh(33, 64)
    lse, _ = ce.cross_entropy_forward(logits, target)
    ce.cross_entropy_backward(logits, target, lse, torch.ones(()))
    source = ce.KERNEL_SOURCE.read_text()
    assert [name for name, _, _ in recorded] == ["pl_ce_forward", "pl_ce_backward"]
    for name, kinds, values in recorded:
        assert kinds == declared_kinds(source, name), name
        assert values[-3:] == (33, 64, 64), name  # rows, vocab, row stride
