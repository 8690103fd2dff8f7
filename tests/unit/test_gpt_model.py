"""The built-in GPT (models/): split invariance, a forward against a plain-torch reference, causality, RoPE, the
FLOP formulas against torch's FLOP counter, and a tiny model that learns the default text corpus."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from peerline.distributed.config import ConfigError
from peerline.kernels.fused_linear import FusedLinear
from peerline.models import (
    GPTBlock,
    LMHead,
    TokenEmbedding,
    build_gpt_layers,
    gpt_flops_per_token,
    gpt_layer_costs,
    gpt_matmul_params,
    peak_bf16_tflops,
)
from peerline.models.rope import apply_rope, rope_tables

TINY = dict(vocab=97, hidden=32, heads=4, layers=3, seq=16)


def build(**overrides) -> list[torch.nn.Module]:
    return build_gpt_layers(**{**TINY, "seed": 7, "kernels": "torch", **overrides})


def run(layers: list[torch.nn.Module], ids: torch.Tensor) -> torch.Tensor:
    x = ids
    for layer in layers:
        x = layer(x)
    return x


def flat_params(layers: list[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    return [(f"{type(m).__name__}.{n}", p) for m in layers for n, p in m.named_parameters()]


@pytest.mark.parametrize("tie", [False, True])
def test_any_split_builds_the_same_weights(tie: bool) -> None:
    total = TINY["layers"] + 2
    whole = flat_params(build(tie_embeddings=tie))
    for k in range(1, total):
        parts = flat_params(build(stop=k, tie_embeddings=tie) + build(start=k, tie_embeddings=tie))
        assert [n for n, _ in parts] == [n for n, _ in whole]
        for (name, a), (_, b) in zip(parts, whole):
            assert torch.equal(a, b), f"split at {k}: {name} differs"


def test_layout_and_tied_head_starts_as_the_embedding() -> None:
    layers = build(tie_embeddings=True)
    assert isinstance(layers[0], TokenEmbedding) and isinstance(layers[-1], LMHead)
    assert all(isinstance(b, GPTBlock) for b in layers[1:-1]) and len(layers) == TINY["layers"] + 2
    head_only = build(start=TINY["layers"] + 1, tie_embeddings=True)[0]
    assert torch.equal(head_only.out.weight, layers[0].weight)
    assert not torch.equal(build()[-1].out.weight, layers[0].weight)


def reference_block(block: GPTBlock, x: torch.Tensor) -> torch.Tensor:
    """The block in plain torch: explicit masked softmax attention and RoPE as a complex rotation."""
    b, t, h = x.shape
    nh, hd = block.heads, block.head_dim
    q, k, v = F.linear(F.layer_norm(x, (h,), block.norm1.weight, block.norm1.bias), block.qkv.weight).split(h, -1)
    q, k, v = (z.view(b, t, nh, hd).transpose(1, 2) for z in (q, k, v))
    freqs = 1.0 / 10_000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    turn = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64), torch.outer(torch.arange(t).double(), freqs))

    def rotate(z: torch.Tensor) -> torch.Tensor:
        c = torch.complex(z[..., : hd // 2].double(), z[..., hd // 2:].double()) * turn
        return torch.cat([c.real, c.imag], -1).float()

    scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h)
    x = x + F.linear(att, block.proj.weight)
    hidden = F.gelu(F.linear(F.layer_norm(x, (h,), block.norm2.weight, block.norm2.bias), block.fc1.weight)
                    + block.fc1_bias)
    return x + F.linear(hidden, block.fc2.weight, block.fc2.bias)


def test_forward_matches_a_plain_torch_reference() -> None:
    layers = build()
    ids = torch.randint(0, TINY["vocab"], (2, TINY["seq"]))
    logits = run(layers, ids)
    assert logits.shape == (2, TINY["seq"], TINY["vocab"]) and logits.dtype == torch.float32
    x = layers[0].weight[ids]
    for block in layers[1:-1]:
        x = reference_block(block, x)
    head = layers[-1]
    expected = F.linear(F.layer_norm(x, (TINY["hidden"],), head.norm.weight, head.norm.bias), head.out.weight)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_attention_is_causal() -> None:
    layers = build()
    ids = torch.randint(0, TINY["vocab"], (1, TINY["seq"]))
    t = 5
    changed = ids.clone()
    changed[0, t + 1] = (ids[0, t + 1] + 1) % TINY["vocab"]
    a, b = run(layers, ids), run(layers, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_rope_shapes_and_relative_positions() -> None:
    cos, sin = rope_tables(16, 8)
    assert cos.shape == sin.shape == (16, 8) and cos.dtype == torch.float32
    x = torch.randn(2, 3, 10, 8, dtype=torch.bfloat16)
    y = apply_rope(x, cos, sin)
    assert y.shape == x.shape and y.dtype == x.dtype
    # The score of a rotated (q at m, k at n) depends only on m - n.
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cos64, sin64 = rope_tables(16, 8)

    def score(m: int, n: int) -> float:
        qs = apply_rope(q.float().expand(16, 8), cos64, sin64)[m]
        ks = apply_rope(k.float().expand(16, 8), cos64, sin64)[n]
        return float(qs @ ks)

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(0, 0) == pytest.approx(float(q.float() @ k.float()), abs=1e-5)
    block = build(start=1, stop=2)[0]
    assert "rope_cos" not in block.state_dict() and block.rope_cos.shape == (TINY["seq"], 8)


def test_flops_per_token_by_hand_and_by_torch_counter() -> None:
    vocab, hidden, layers, seq = 10, 4, 2, 8
    per_block = 4 * 3 * 4 + 4 * 4 + 4 * 16 + 16 * 4  # qkv, proj, fc1, fc2 weights
    assert gpt_matmul_params(vocab=vocab, hidden=hidden, layers=layers) == 2 * per_block + 4 * 10
    assert gpt_flops_per_token(vocab=vocab, hidden=hidden, layers=layers, seq=seq) == 6 * 424 + 12 * 2 * 4 * 8
    model = build()
    fused = sum(m.weight.numel() for layer in model for m in layer.modules() if isinstance(m, FusedLinear))
    assert fused == gpt_matmul_params(vocab=TINY["vocab"], hidden=TINY["hidden"], layers=TINY["layers"])
    ids = torch.randint(0, TINY["vocab"], (2, TINY["seq"]))
    # The math backend runs attention as matmuls the counter sees (it counts the full T x T scores, as the
    # formula does); the CPU's fused kernel is not in the counter's table.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        run(model, ids).sum().backward()
    shape = {k: TINY[k] for k in ("vocab", "hidden", "layers", "seq")}
    assert counter.get_total_flops() == gpt_flops_per_token(**shape) * ids.numel()


def test_layer_costs_balance_blocks_and_head() -> None:
    costs = gpt_layer_costs(vocab=50_000, hidden=1024, layers=4, seq=2048)
    assert len(costs) == 6 and 0 < costs[0] < costs[1]
    assert costs[1:5] == [costs[1]] * 4
    assert costs[5] == 2 * 1024 * 50_000
    assert costs[1] == 2 * 12 * 1024 ** 2 + 2 * 2048 * 1024


def test_peak_table() -> None:
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_bf16_tflops("NVIDIA H200") == 989.4
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") != 989.4
    assert peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None


def test_bad_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        build(hidden=30)
    with pytest.raises(ConfigError, match="even"):
        build(hidden=36, heads=4, layers=1)  # head width 9
    with pytest.raises(ConfigError, match="range"):
        build(start=3, stop=3)
    with pytest.raises(TypeError, match="token ids"):
        build(stop=1)[0](torch.randn(2, 4))


@pytest.mark.slow
def test_tiny_gpt_learns_the_default_corpus(tmp_path) -> None:
    from peerline.distributed.data.sampler import TokenSampler
    from peerline.distributed.data.tokenizer import text_tokens

    tokens = text_tokens(cache_root=tmp_path, vocab_size=512, cap_bytes=400_000)
    vocab, seq = tokens.vocab, 64
    layers = build_gpt_layers(vocab=vocab, hidden=64, heads=4, layers=2, seq=seq, seed=0, kernels="torch")
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sampler = TokenSampler(tokens.tokens, seq=seq, micro_batch_size=16, seed=0)
    losses = []
    for step in range(60):
        inputs, labels = sampler.batch(step, 0)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(vocab)) < 0.5, losses[0]
    assert sum(losses[-5:]) / 5 < math.log(vocab) - 1.5, losses
