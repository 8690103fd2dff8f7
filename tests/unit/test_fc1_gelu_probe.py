"""tools/gpu_probes/fc1_gelu_probe.py on the CPU: every variant computes the same gradients, and the probe times
each one at a shape given on its command line."""

import sys

import torch

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "gpu_probes"))
import fc1_gelu_probe as probe  # noqa: E402


def test_the_three_ways_give_the_same_gradients() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(6, 8, dtype=torch.float64, generator=gen).requires_grad_(True)
    w = torch.randn(32, 8, dtype=torch.float64, generator=gen).requires_grad_(True)
    b = torch.randn(32, dtype=torch.float64, generator=gen).requires_grad_(True)
    dy = torch.randn(6, 32, dtype=torch.float64, generator=gen)
    fns = probe.variants(x, w, b, dy)
    want = fns["torch"]()
    for name in ("split", "epilogue"):
        for got, ref in zip(fns[name](), want, strict=True):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), name
    assert torch.allclose(fns["gemm+bias fwd"](), fns["gemm fwd"]() + b.detach())
    assert torch.allclose(fns["gelu fwd ours"](), fns["gelu fwd torch"]())
    for got, ref in zip(fns["gelu bwd ours"](), fns["gelu bwd torch"](), strict=True):
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_the_probe_times_every_variant(capsys) -> None:
    got = probe.main(["--shapes", "16x8", "--iters", "2", "--reps", "2", "--device", "cpu", "--graph", "--flush-l2"])
    assert set(got["16x8"]) == {"torch", "split", "epilogue", "gemm+bias fwd", "gemm fwd", "gelu fwd ours",
                                "gelu fwd torch", "gelu bwd ours", "gelu bwd torch"}
    assert all(v > 0 for v in got["16x8"].values())
    out = capsys.readouterr().out
    assert "INFO 16x8 (torch.float32, cpu, eager)" in out and "need a GPU" in out
