"""The residual-MLP block's eager fast path under --kernels auto (distributed/model.py: forward_torch_ops, taken
where ops.mlp_block_on_torch says every op would run torch's own). It runs only on a GPU; here, on the CPU, its
contract: the direct ops give bitwise the per-op path's output and gradients, and the decision follows the card's
table for each op, cached after the first call (fake CUDA tensors: no kernel is built or launched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peerline.distributed.model import ResidualMLPBlock
from peerline.kernels import card_table as ct
from peerline.kernels import elementwise as ew
from peerline.kernels import ops

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_ops_match_the_per_op_path_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    block = ResidualMLPBlock(24, kernels="torch").to(dtype)
    x = torch.randn(3, 5, 24, dtype=dtype)
    y = torch.randn(3, 5, 24, dtype=dtype)
    got_grads, want_grads = [], []
    def per_op(x: torch.Tensor) -> torch.Tensor:
        """What the per-op path runs where auto's eager rules pick torch for each op (ops.linear_bias_gelu: fc1's
        bias in the GEMM's epilogue; FusedLinear's plain F.linear; torch's add)."""
        h = torch.nn.functional.gelu(block.fc1.with_bias(block.norm(x), block.fc1_bias))
        return ops.residual_add(x, block.fc2(h), "torch")

    for run, grads in ((block.forward_torch_ops, got_grads), (per_op, want_grads)):
        xi = x.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        out = run(xi)
        (out.float() * y.float()).sum().backward()
        grads.append(out.detach())
        grads.append(xi.grad)
        grads.extend(p.grad for p in block.parameters())
    assert len(got_grads) == 2 + 6
    for got, want in zip(got_grads, want_grads):
        assert got is not None and got.dtype == want.dtype and torch.equal(got, want)


class FakeCuda:
    """What mlp_block_on_torch reads of a CUDA activation."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: int = 1) -> None:
        self.shape, self.dtype, self.is_cuda = torch.Size(shape), dtype, True
        self.device = SimpleNamespace(type="cuda")
        self._device = device

    def numel(self) -> int:
        return self.shape.numel()

    def get_device(self) -> int:
        return self._device


def _table(bias_gelu: str, residual: str) -> ct.CardTable:
    """A card whose captured launches all pick `bias_gelu` / `residual` and whose eager launches pick torch
    below 1 GiB (bias+GELU) or always (the add)."""
    return ct.CardTable.from_entry("NVIDIA H200", {
        "choice": {"bias_gelu_fwd:bf16": [[1, bias_gelu]], "bias_gelu_bwd:bf16": [[1, bias_gelu]],
                   "residual_add:bf16": [[1, residual]]},
        "eager_torch_below": {"bias_gelu_fwd": 1 << 30, "bias_gelu_bwd": 1 << 30, "residual_add": ct.NEVER_EAGER}})


def test_the_decision_follows_each_ops_rule_and_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    block = ResidualMLPBlock(16, kernels="auto").to(torch.bfloat16)
    lookups: list[int] = []
    warmed: list[tuple] = []
    table = _table("torch", "torch")
    monkeypatch.setattr(ew, "card_table", lambda index: lookups.append(index) or table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    monkeypatch.setattr(ew, "_warm", lambda key, build: warmed.append(key))
    x = FakeCuda((2, 4, 16), torch.bfloat16)
    assert ops.mlp_block_on_torch(x, block.fc1.weight, block.fc1_bias, block.fc2.weight)
    n = len(lookups)
    assert n >= 1 and not warmed  # torch everywhere, captured too: nothing to build ahead of a capture
    assert ops.mlp_block_on_torch(x, block.fc1.weight, block.fc1_bias, block.fc2.weight)
    assert len(lookups) == n  # the second call is one cached lookup

    # A capture at this size would run the kernels: the eager call still takes torch's ops, and builds them first.
    monkeypatch.setattr(ew, "_CHOICES", {})
    table = _table("peerline", "torch")
    assert ops.mlp_block_on_torch(x, block.fc1.weight, block.fc1_bias, block.fc2.weight)
    assert any(key[0] == "bias_gelu" for key in warmed)

    # An eager bias+GELU the card gives to the kernel (above its eager threshold): not the direct path.
    monkeypatch.setattr(ew, "_CHOICES", {})
    table = ct.CardTable.from_entry("NVIDIA H200", {
        "choice": {"bias_gelu_fwd:bf16": [[1, "peerline"]], "bias_gelu_bwd:bf16": [[1, "peerline"]],
                   "residual_add:bf16": [[1, "torch"]]},
        "eager_torch_below": {"bias_gelu_fwd": 0, "bias_gelu_bwd": 0, "residual_add": ct.NEVER_EAGER}})
    assert not ops.mlp_block_on_torch(x, block.fc1.weight, block.fc1_bias, block.fc2.weight)

    # A GEMM of EAGER_FUSED_MIN_MACS multiply-adds or more (rows x weight elements): the device is the bottleneck,
    # the fused Linears (dW added in the GEMM) run, so the block keeps the per-op path.
    from peerline.kernels import fused_linear

    table = _table("torch", "torch")
    macs = 2 * 4 * block.fc1.weight.numel()  # x's 8 rows through fc1 (fc2 has as many elements)
    for limit, direct in ((macs, False), (macs + 1, True)):
        monkeypatch.setattr(ew, "_CHOICES", {})
        monkeypatch.setattr(fused_linear, "EAGER_FUSED_MIN_MACS", limit)
        assert ops.mlp_block_on_torch(x, block.fc1.weight, block.fc1_bias, block.fc2.weight) == direct


def test_fp32_weights_without_autocast_keep_the_fused_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 weights computing in fp32 take the fused Linear (its dW accumulation), so the block keeps the per-op
    path whatever the elementwise ops would pick."""
    block = ResidualMLPBlock(16, kernels="auto")
    table = _table("torch", "torch")
    monkeypatch.setattr(ew, "card_table", lambda index: table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    assert not ops.mlp_block_on_torch(FakeCuda((2, 4, 16), torch.float32), block.fc1.weight, block.fc1_bias,
                                      block.fc2.weight)
