"""Bucket layout and gradient views of GradBuckets, one process (no all-reduce: dp = 1)."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.buckets import ALIGN_BYTES, GradBuckets, MiB, plan_buckets, ready_order

pytestmark = pytest.mark.timeout(60)


def P(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape).to(dtype), requires_grad=grad)


def names(buckets, table) -> list[list[str]]:
    inv = {id(p): n for n, p in table.items()}
    return [[inv[id(p)] for p in b.params] for b in buckets]


def test_ready_order_is_last_layer_first_and_reverse_inside_a_layer() -> None:
    a, b, c, d = P(2), P(3), P(4), P(5)
    frozen = P(6, grad=False)
    order = ready_order([[a, b], [c, frozen], [d, a]])  # `a` tied: counted once, where backward finishes it
    assert [id(p) for p in order] == [id(a), id(d), id(c), id(b)]


def test_large_parameter_gets_its_own_bucket_and_tiny_first_bucket() -> None:
    # 1 KiB first bucket, 8 KiB buckets; floats: 4 bytes, alignment 256 bytes = 64 floats.
    t = {"bias": P(3), "w_out": P(40, 10), "big": P(50, 50), "w1": P(16, 16), "w2": P(8, 8), "b2": P(8)}
    layers = [[t["w1"]], [t["w2"], t["b2"]], [t["big"]], [t["w_out"], t["bias"]]]
    buckets = plan_buckets(ready_order(layers), bucket_mb=8 / 1024, first_bucket_mb=1 / 1024)
    assert names(buckets, t) == [["bias"], ["w_out"], ["big"], ["b2", "w2", "w1"]]
    assert buckets[0].nbytes == ALIGN_BYTES  # a 3-float bias padded to the alignment
    assert buckets[2].nbytes >= 8 * 1024  # larger than the cap, alone
    # Offsets tile one flat buffer without overlap, in bucket order.
    end = 0
    for b in buckets:
        assert b.offset == end and b.numel % (ALIGN_BYTES // 4) == 0
        end += b.numel


def test_bucket_closes_at_cap_and_dtype_change() -> None:
    t = {f"p{i}": P(64) for i in range(6)} | {"h": P(64, dtype=torch.bfloat16)}
    layers = [[t["p0"], t["p1"], t["p2"]], [t["h"]], [t["p3"], t["p4"], t["p5"]]]
    # 64 floats = 256 bytes each; cap 512 bytes: two per bucket. The bf16 one sits alone between them.
    buckets = plan_buckets(ready_order(layers), bucket_mb=512 / MiB, first_bucket_mb=512 / MiB)
    assert names(buckets, t) == [["p5", "p4"], ["p3"], ["h"], ["p2", "p1"], ["p0"]]
    assert [b.dtype for b in buckets] == [torch.float32] * 2 + [torch.bfloat16] + [torch.float32] * 2
    assert buckets[3].offset == buckets[1].offset + buckets[1].numel  # fp32 flat continues after the bf16 gap
    assert buckets[2].offset == 0


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([P(3)], bucket_mb=0, first_bucket_mb=1)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.GELU(), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5))


def test_grads_are_views_into_the_flat_buffer_and_accumulate_in_place() -> None:
    model, ref = _mlp(), _mlp()
    gb = GradBuckets([list(m.parameters()) for m in model], None, torch.device("cpu"), None, 0.001, 0.0005)
    assert len(gb.buckets) > 1
    flat = gb.flat[torch.float32]
    flat.fill_(float("nan"))  # poison: zero_grad must clear every element
    gb.zero_grad()
    assert not flat.isnan().any()
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    x = torch.randn(4, 9)
    for _ in range(2):  # accumulation over two microbatches, without arm(): hooks (none at dp = 1) do nothing
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # A write into the flat buffer is visible through .grad: they alias.
    first = model[3].bias
    b = next(b for b in gb.buckets if any(q is first for q in b.params))
    start = b.offset + b.starts[[id(q) for q in b.params].index(id(first))]
    flat[start] = 123.0
    assert first.grad[0].item() == 123.0
    gb.arm()
    gb.finish()
    m = gb.metrics()
    assert m["dp"] == 1 and m["allreduce_ms"] == 0.0 and m["buckets"] == len(gb.buckets)


def test_zero_grad_repoints_a_replaced_grad() -> None:
    model = _mlp()
    gb = GradBuckets([list(m.parameters()) for m in model], None, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    gb.zero_grad()
    flat = gb.flat[torch.float32]
    for p in model.parameters():
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_existing_grads_are_kept() -> None:
    model = _mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.5)
    GradBuckets([list(m.parameters()) for m in model], None, torch.device("cpu"))
    assert all(bool((p.grad == 2.5).all()) for p in model.parameters())
