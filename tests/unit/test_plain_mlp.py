"""bench/suites/plain_mlp.py, the anchors' residual MLP: the default model's parameters and function, written as a
PyTorch user writes it (fc1's bias inside nn.Linear), holding the default layers' weights."""

from __future__ import annotations

import torch
import torch.nn as nn

from peerline.bench.suites.plain_mlp import PlainMLPBlock, from_default_layers
from peerline.bench.suites.torch_pipelining import PipeShape, build_stage_modules
from peerline.distributed.model import ResidualMLPBlock


def test_same_parameters_and_function_as_the_default_block_in_float64():
    torch.manual_seed(int(torch.randint(0, 1 << 30, ())))
    ours = nn.Sequential(*[ResidualMLPBlock(16, "torch") for _ in range(3)]).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorm's weight and bias off their 1 / 0 init too
    plain = from_default_layers(ours)
    assert all(isinstance(b, PlainMLPBlock) for b in plain)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in ours.parameters())
    assert not any(isinstance(m, ResidualMLPBlock) for m in plain.modules())
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = plain(x), ours(x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for block, layer in zip(plain, ours):
        torch.testing.assert_close(block.fc1.bias.grad, layer.fc1_bias.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(block.fc2.weight.grad, layer.fc2.weight.grad, rtol=1e-12, atol=1e-12)


def test_stage_modules_hold_the_layers_of_their_stage():
    shape = PipeShape("t", layers=4, hidden=8, micro_batch_size=1, seq=2, microbatches=2, dtype="fp32", seed=3)
    whole = build_stage_modules(shape, 1, [0])[0]
    halves = build_stage_modules(shape, 2, [0, 1])
    assert [len(h) for h in halves] == [2, 2]
    for got, want in zip([*halves[0], *halves[1]], whole):
        assert isinstance(got, PlainMLPBlock)
        for a, b in zip(got.state_dict().values(), want.state_dict().values()):
            assert torch.equal(a, b)


def test_a_stage_is_timed_alone_on_the_input_its_pipeline_gives_it():
    """measure_stage_ms (the pipeline suite's ideal time): a stage with bf16 parameters gets bf16 inputs without
    autocast, as the bf16 recipes hand their boundaries on; fp32 parameters of a bf16 shape get fp32 inputs under
    bf16 autocast. Both passes run and the stage keeps no gradient."""
    from peerline.bench.suites.torch_pipelining import measure_stage_ms

    shape = PipeShape("t", layers=2, hidden=8, micro_batch_size=1, seq=4, microbatches=2, dtype="bf16", seed=5)
    for dtype in (torch.bfloat16, torch.float32):
        module = build_stage_modules(shape, 1, [0])[0].to(dtype)
        seen: list[tuple[torch.dtype, bool, bool]] = []
        module.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(
            (args[0].dtype, args[0].requires_grad, torch.is_autocast_enabled("cpu"))))
        fwd, bwd = measure_stage_ms(module, shape, torch.device("cpu"), is_first=False, is_last=False, warmup=1,
                                    reps=2)
        assert fwd > 0 and bwd >= 0 and seen
        assert set(seen) == {(dtype, True, dtype == torch.float32)}, (dtype, set(seen))
        assert all(p.grad is None for p in module.parameters())
