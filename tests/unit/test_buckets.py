"""Bucket layout and gradient views of GradBuckets, one process (no all-reduce: dp = 1)."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.grad_sync.buckets import ALIGN_BYTES, GradBuckets, MiB, plan_buckets, ready_order

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


def test_large_parameter_closes_the_bucket_it_joins_and_small_ones_ride_with_it() -> None:
    # 1 KiB first bucket, 8 KiB buckets; floats: 4 bytes, alignment 256 bytes = 64 floats.
    t = {"bias": P(3), "w_out": P(40, 10), "big": P(50, 50), "w1": P(16, 16), "w2": P(8, 8), "b2": P(8)}
    layers = [[t["w1"]], [t["w2"], t["b2"]], [t["big"]], [t["w_out"], t["bias"]]]
    buckets = plan_buckets(ready_order(layers), bucket_mb=8 / 1024, first_bucket_mb=1 / 1024)
    # The 3-float bias (256 bytes padded) is no bucket of its own: it rides with w_out, which fills the first
    # bucket past 1 KiB. `big` (10 KiB > 8 KiB) fills a bucket by itself. The rest (1.5 KiB) is the last bucket.
    assert names(buckets, t) == [["bias", "w_out"], ["big"], ["b2", "w2", "w1"]]
    assert buckets[0].starts == [0, ALIGN_BYTES // 4]  # the bias padded to the alignment
    assert buckets[1].nbytes >= 8 * 1024
    # Offsets tile one flat buffer without overlap, in bucket order.
    end = 0
    for i, b in enumerate(buckets):
        assert b.index == i and b.offset == end and b.numel % (ALIGN_BYTES // 4) == 0
        end += b.numel


def test_small_parameters_before_a_big_one_join_its_bucket() -> None:
    # The suite's block in ready order: down.bias, down.weight, bias, up.weight, norm.bias, norm.weight; with
    # weights larger than a bucket the old plan gave every weight its own bucket and left the small parameters
    # between them as buckets of a few KiB. Here each small one rides with the next weight.
    h = 64  # fp32: weights 4 * 64 * 64 * 4 = 64 KiB, vectors 256 B (h) or 1 KiB (4h)
    blocks = [{"ln_w": P(h), "ln_b": P(h), "up": P(4 * h, h), "bias": P(4 * h), "down": P(h, 4 * h),
               "down_b": P(h)} for _ in range(3)]
    layers = [list(b.values()) for b in blocks]
    t = {f"{k}{i}": p for i, b in enumerate(blocks) for k, p in b.items()}
    buckets = plan_buckets(ready_order(layers), bucket_mb=48 / 1024, first_bucket_mb=1 / 1024)
    assert names(buckets, t) == [["down_b2", "down2"], ["bias2", "up2"], ["ln_b2", "ln_w2", "down_b1", "down1"],
                                 ["bias1", "up1"], ["ln_b1", "ln_w1", "down_b0", "down0"], ["bias0", "up0"],
                                 ["ln_b0", "ln_w0"]]
    assert all(b.nbytes >= 48 * 1024 for b in buckets[1:-1])  # only the first cap is smaller, the last is the rest
    assert buckets[0].nbytes >= 1024 and buckets[-1].nbytes == 2 * h * 4


def test_tiny_parameter_alone_only_as_the_last_bucket() -> None:
    t = {"tiny": P(1), "w": P(300), "w2": P(300)}
    # ready order: w2, w, tiny. 300 floats -> 320 floats = 1280 B; cap 2 KiB: w2 + w close it, tiny is last.
    buckets = plan_buckets(ready_order([[t["tiny"]], [t["w"]], [t["w2"]]]), bucket_mb=2 / 1024,
                           first_bucket_mb=2 / 1024)
    assert names(buckets, t) == [["w2", "w"], ["tiny"]]
    assert buckets[-1].nbytes == ALIGN_BYTES


def _aligned_bytes(p: torch.nn.Parameter) -> int:
    item = p.element_size()
    step = ALIGN_BYTES // item
    return -(-p.numel() // step) * step * item


@pytest.mark.parametrize("seed", range(5))
def test_every_bucket_but_a_dtypes_last_reaches_its_cap(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 5000, (60,), generator=g)]
    dtypes = [torch.float32 if int(d) else torch.bfloat16 for d in torch.randint(0, 2, (60,), generator=g)]
    params = [P(n, dtype=dt) for n, dt in zip(sizes, dtypes, strict=True)]
    first, cap = 2 / 1024, 9 / 1024
    buckets = plan_buckets(params, bucket_mb=cap, first_bucket_mb=first)
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(id(p) for p in params)  # each once
    pos = {id(p): i for i, p in enumerate(params)}
    lasts = [max(pos[id(p)] for p in b.params) for b in buckets]
    assert lasts == sorted(lasts)  # numbered in the order they complete in backward
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for dt in (torch.float32, torch.bfloat16):
        mine = [b for b in buckets if b.dtype == dt]
        end = 0
        for k, b in enumerate(mine):
            assert b.offset == end  # the dtype's flat buffer is tiled in bucket order
            end += b.numel
            in_order = [pos[id(p)] for p in b.params]
            assert in_order == sorted(in_order)
            limit = (first if k == 0 else cap) * MiB
            if k < len(mine) - 1:
                assert b.nbytes >= limit
            # Only its last parameter took it to the cap: no bucket closes early.
            assert b.nbytes - _aligned_bytes(b.params[-1]) < limit


def test_the_suite_model_gets_full_buckets_and_one_small_last() -> None:
    # 8 blocks of h=2048 in bf16 (the allreduce suite's model), on the meta device: sizes only.
    h = 2048

    def M(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(*shape, dtype=torch.bfloat16, device="meta"))

    layers = [[M(h), M(h), M(4 * h, h), M(4 * h), M(h, 4 * h), M(h)] for _ in range(8)]
    buckets = plan_buckets(ready_order(layers), bucket_mb=25, first_bucket_mb=1)
    assert len(buckets) == 17
    assert all(b.nbytes >= 32 * MiB for b in buckets[:-1])  # each 32 MiB weight plus the small ones before it
    assert buckets[-1].nbytes == 2 * 2 * h  # the first block's LayerNorm: what is left at the end
    assert sum(len(b.params) for b in buckets) == 48


def test_dtypes_fill_their_own_buckets() -> None:
    t = {f"p{i}": P(64) for i in range(6)} | {"h": P(64, dtype=torch.bfloat16)}
    layers = [[t["p0"], t["p1"], t["p2"]], [t["h"]], [t["p3"], t["p4"], t["p5"]]]
    # 64 floats = 256 bytes each; cap 512 bytes: two per bucket. The bf16 one does not cut the fp32 run: p3 and
    # p2 share a bucket across it. The bf16 remainder is its dtype's last bucket, numbered where it completes in
    # backward (with `h`, before p3 + p2 completes), which is where it launches.
    buckets = plan_buckets(ready_order(layers), bucket_mb=512 / MiB, first_bucket_mb=512 / MiB)
    assert names(buckets, t) == [["p5", "p4"], ["h"], ["p3", "p2"], ["p1", "p0"]]
    assert [b.dtype for b in buckets] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    assert [b.offset for b in buckets] == [0, 0, 128, 256]


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


def test_nccl_options_cap_the_ctas(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from peerline.distributed.grad_sync import buckets
    class FakeOptions:  # what torch's ProcessGroupNCCL.Options exposes: .config with max_ctas / min_ctas
        def __init__(self) -> None:
            self.config = SimpleNamespace(max_ctas=-2147483648, min_ctas=-2147483648)

    assert buckets.nccl_options(None) is None  # no cap: the backend's defaults
    assert buckets.nccl_options(8, backend="gloo") is None
    monkeypatch.setattr(buckets.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(buckets.dist, "ProcessGroupNCCL", SimpleNamespace(Options=FakeOptions), raising=False)
    opts = buckets.nccl_options(8)
    assert opts.config.max_ctas == 8 and opts.config.min_ctas == -2147483648  # min left to NCCL
    opts = buckets.nccl_options(16, 4)
    assert (opts.config.max_ctas, opts.config.min_ctas) == (16, 4)
    for bad in ((0, None), (65, None), (4, 8)):
        with pytest.raises(ValueError, match="ctas"):
            buckets.nccl_options(*bad)
