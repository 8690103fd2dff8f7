"""Stage boundaries of several tensors (pipeline/boundary.py): specs, packing, the gradient message, the checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import ACT, TensorSpec
from peerline.distributed.pipeline import boundary
from peerline.distributed.pipeline.boundary import ALIGN, BoundarySpec, layout, pack, unpack
from peerline.distributed.pipeline.boundary_shapes import probe_stages
from peerline.distributed.pipeline.engine import Engine, LocalStage
from tests.unit import test_slot_ring_transport as ring

sim, small_split = ring.sim, ring.small_split  # the CPU-simulated GPU of the copy-engine tests (fixtures)


def mixed_leaves(gen: torch.Generator) -> list[torch.Tensor]:
    """Fresh random leaves of every kind a boundary carries, with sizes that leave odd byte counts between them."""
    return [torch.randn(3, 5, generator=gen),
            torch.randint(-2**40, 2**40, (7,), generator=gen),
            torch.randn(2, 3, 3, generator=gen).to(torch.bfloat16),
            torch.randint(0, 2, (5,), generator=gen).bool(),
            torch.randn((), generator=gen, dtype=torch.float64),
            torch.randn(3, generator=gen).half(),
            torch.empty(0, 4),
            torch.randint(-100, 100, (3, 1), generator=gen, dtype=torch.int32)]


def test_pack_unpack_round_trip_mixed_dtypes_and_shapes():
    leaves = mixed_leaves(torch.Generator().manual_seed(1))
    specs = [TensorSpec(tuple(t.shape), t.dtype) for t in leaves]
    buf = pack(leaves)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() % ALIGN == 0
    out = unpack(buf, specs)
    for got, want in zip(out, leaves):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    # Views into the message, not copies: writing the buffer changes the leaves.
    offsets, _ = layout([t.numel() * t.element_size() for t in leaves])
    assert [t.data_ptr() - buf.data_ptr() for t in out if t.numel()] == [o for o, t in zip(offsets, out) if t.numel()]
    buf.zero_()
    assert not out[0].any() and not out[1].any()


def test_layout_aligns_every_leaf():
    offsets, total = layout([3, 1, 17, 0, 8, 32])
    assert offsets == [0, 16, 32, 64, 64, 80] and total == 112
    assert all(o % ALIGN == 0 for o in offsets)
    leaves = mixed_leaves(torch.Generator().manual_seed(2))
    offsets, total = layout([t.numel() * t.element_size() for t in leaves])
    assert pack(leaves).numel() == total
    assert all(o % ALIGN == 0 for o in offsets)


def test_unpack_rejects_a_message_of_the_wrong_size():
    with pytest.raises(ValueError, match="packed message of 16 bytes expected"):
        unpack(torch.zeros(32, dtype=torch.uint8), [TensorSpec((3,), torch.float32)])


@pytest.mark.parametrize("value,n_leaves", [
    (lambda h, p: {"h": h, "pos": p}, 2),
    (lambda h, p: (h, p), 2),
    (lambda h, p: [h, {"inner": (p, h)}], 3),
    (lambda h, p: {"b": h, "a": (p,)}, 2),
])
def test_spec_of_tuples_and_dicts_round_trips_through_json(value, n_leaves):
    h, p = torch.randn(2, 4), torch.arange(4)
    v = value(h, p)
    spec = BoundarySpec.of(v, "stage 0's output")
    assert len(spec.leaves) == n_leaves and not spec.is_tensor
    again = BoundarySpec.from_json(spec.to_json())
    assert again == spec and again.treedef == spec.treedef
    rebuilt = boundary.unflatten(boundary.flatten(v), again)
    assert type(rebuilt) is type(v) and spec.mismatch(rebuilt) is None


def test_single_tensor_keeps_todays_message():
    t = torch.randn(2, 3)
    spec = BoundarySpec.of(t, "stage 0's output")
    assert spec.is_tensor and spec == BoundarySpec.of_tensor(TensorSpec((2, 3), torch.float32))
    assert spec.message == spec.grad_message == TensorSpec((2, 3), torch.float32)
    assert boundary.act_message(t).data_ptr() == t.data_ptr()  # sent as it is: no packing, no copy


def test_messages_of_a_structure():
    h, gate, pos = torch.randn(2, 4), torch.randn(2, 1, dtype=torch.float64), torch.arange(4)
    spec = BoundarySpec.of((h, gate, pos), "s")
    assert spec.float_index == (0, 1)
    assert spec.message == TensorSpec((32 + 16 + 32,), torch.uint8)
    assert spec.grad_message == TensorSpec((32 + 16,), torch.uint8)  # the floating leaves only
    # One floating leaf: its gradient travels as the tensor itself.
    one = BoundarySpec.of({"h": h, "pos": pos}, "s")
    assert one.grad_message == TensorSpec((2, 4), torch.float32)
    got = boundary.received_input(boundary.act_message((h, gate, pos)), spec)
    assert isinstance(got, tuple) and torch.equal(got[0], h) and torch.equal(got[2], pos)
    assert got[0].requires_grad and got[1].requires_grad and not got[2].requires_grad


def test_gradient_message_holds_the_float_leaves_only_with_zeros_for_unused():
    spec = BoundarySpec.of((torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64),
                            torch.zeros(2, 1, dtype=torch.bfloat16)), "s")
    x = boundary.received_input(pack([torch.randn(2, 3), torch.arange(3), torch.ones(2, 1).bfloat16()]), spec)
    (x[0] * 3).sum().backward()  # the bf16 leaf is unused: no .grad
    grads = boundary.input_grads(x, spec)
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16]
    assert torch.equal(grads[0], torch.full((2, 3), 3.0)) and not grads[1].any()
    message = boundary.grad_message(grads)
    assert message.dtype == torch.uint8 and message.numel() == spec.grad_message.shape[0]
    back = boundary.received_grads(message, spec)
    assert all(torch.equal(a, b) for a, b in zip(back, grads))


def test_backward_from_a_structure_matches_autograd_and_skips_leaves_without_grad():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    h = lin(x)
    out = {"h": h, "mask": torch.ones(3, 1), "pos": torch.arange(3)}  # mask: float, no gradient flows into it
    spec = BoundarySpec.of(out, "s")
    g_h, g_mask = torch.randn(3, 4), torch.randn(3, 1)
    boundary.backward(out, [g_h, g_mask], spec)
    want = torch.autograd.grad(lin(x), lin.weight, g_h)[0]
    assert torch.allclose(lin.weight.grad, want)


@pytest.mark.parametrize("value,message", [
    ((torch.zeros(2), 3), r"stage 1's output gives int at \[1\]"),
    ({"h": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)}, r"gives torch.complex64 at \['z'\]"),
])
def test_bad_leaves_are_one_config_error(value, message):
    with pytest.raises(ConfigError, match=message):
        BoundarySpec.of(value, "stage 1's output")


def test_a_boundary_without_a_float_leaf_is_refused():
    spec = BoundarySpec.of((torch.arange(3), torch.zeros(2, dtype=torch.bool)), "s")
    with pytest.raises(ConfigError, match="stage 2's output hands on no floating-point tensor"):
        spec.check_passable("stage 2's output")


def test_probe_gives_every_stage_its_structure_and_feeds_integers_valid_indices():
    class Split(nn.Module):
        def forward(self, x):
            return {"h": x, "ids": torch.zeros(x.shape[:-1], dtype=torch.int64)}

    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)

        def forward(self, d):
            return d["h"] + self.emb(d["ids"]), d["ids"]

    first = BoundarySpec.of_tensor(TensorSpec((2, 3), torch.float32))
    outs = probe_stages([Split(), Lookup()], first, 0, True, torch.device("cpu"), None)
    assert outs[0].describe() == "{'h': (2, 3) float32, 'ids': (2,) int64}"
    assert outs[1].describe() == "((2, 3) float32, (2,) int64)"
    # An integer-only input (token ids) gets zeros, so an Embedding first layer takes it.
    ids = BoundarySpec.of_tensor(TensorSpec((2, 5), torch.int64))
    assert probe_stages([nn.Embedding(3, 2)], ids, 0, True, torch.device("cpu"), None)[0].shape == (2, 5, 2)
    with pytest.raises(ConfigError, match="stage 4's output hands on no floating-point tensor"):
        probe_stages([nn.Identity()], ids, 4, False, torch.device("cpu"), None)


def test_engine_names_the_leaf_that_changed_between_microbatches():
    out = {"h": torch.zeros(2, 4), "pos": torch.arange(4)}
    stage = LocalStage(index=1, n_stages=3, module=nn.Identity(), stream=None,
                       out_spec=BoundarySpec.of(out, "s"))
    Engine._check_output(stage, 0, out)
    with pytest.raises(ConfigError, match=r"stage 1 output changed between microbatches: microbatch 2 gave "
                                          r"\['pos'\] \(5,\) torch.int64 where the first gave \(4,\)"):
        Engine._check_output(stage, 2, {"h": torch.zeros(2, 4), "pos": torch.arange(5)})
    with pytest.raises(ConfigError, match=r"microbatch 3 gave structure \(\(2, 4\) float32,\)"):
        Engine._check_output(stage, 3, (torch.zeros(2, 4),))
    single = LocalStage(index=0, n_stages=2, module=nn.Identity(), stream=None,
                        out_spec=TensorSpec((2, 4), torch.float32))
    with pytest.raises(ConfigError, match=r"microbatch 1 gave \(2, 5\) torch.float32, the first gave \(2, 4\)"):
        Engine._check_output(single, 1, torch.zeros(2, 5))


@pytest.mark.parametrize("lanes,split", [(1, False), (2, True)])
def test_packed_message_crosses_the_copy_engine_intact(sim, small_split, lanes, split):
    """The real copy-engine transport (CPU-simulated GPU, tests/unit/test_slot_ring_transport.py) built with a
    packed message's uint8 spec: mixed leaves land intact, whole or cut in halves by two lanes."""
    gen = torch.Generator().manual_seed(3)
    sent = [mixed_leaves(gen) for _ in range(3)]
    spec = BoundarySpec.of(tuple(sent[0]), "s")
    tr = ring.build(sim, spec.message, 2, lanes, split)
    keep, got = [], []
    for mb, leaves in enumerate(sent):
        ring.as_rank(sim, 0)
        keep.append(pack(leaves))  # host memory must outlive the simulated copy
        tr[0].exchange([(ACT, mb, keep[-1])], [])
        ring.as_rank(sim, 1)
        (message,) = tr[1].exchange([], [(ACT, mb)])
        copy = torch.empty_like(message)
        sim.compute[1].call(lambda m=message, c=copy: c.copy_(m))
        got.append(copy)
        tr[1].release(ACT, mb)
    ring.as_rank(sim, 0)
    tr[0].finish_iteration()
    assert sim.run(seed=lanes)
    for message, leaves in zip(got, sent):
        for a, b in zip(unpack(message, spec.leaves), leaves):
            assert torch.equal(a, b)
