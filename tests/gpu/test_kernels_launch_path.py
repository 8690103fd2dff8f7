"""GPU tests of the lean launch path (cached decisions, pre-packed arguments, each launcher) and of --kernels auto,
against float64 torch: fresh random inputs every call, outputs poisoned with NaN (elementwise.POISON_OUTPUTS)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

from peerline.kernels import card_table as ct  # noqa: E402
from peerline.kernels import elementwise as ew  # noqa: E402
from peerline.kernels import launch, ops  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
BOUND = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
SHAPES = [(3, 5), (33, 4096), (7, 8193), (512, 512), (2048, 2048)]


def _launchers() -> list[str]:
    names = []
    for name in launch.LAUNCHERS[1:]:
        try:
            launch.launcher(name)
            names.append(name)
        except Exception:  # noqa: BLE001 - a launcher this machine lacks
            continue
    return names


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ew, "POISON_OUTPUTS", True)


def randn(shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.randn(n + offset, device=DEV) * 2).to(dtype)[offset:].view(shape)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    assert torch.isfinite(o).all()
    return ((o - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gelu64(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * torch.special.erfc(-v / math.sqrt(2))


def check_all(dt: torch.dtype, shape: tuple[int, ...], off: int) -> None:
    """One fresh-input forward, backward and residual add against float64."""
    h = shape[-1]
    x, g, y, b = randn(shape, dt, off), randn(shape, dt, off), randn(shape, dt, off), torch.randn(h, device=DEV)
    v = (x.float() + b).double()
    assert rel(ew.bias_gelu_forward(x, b), gelu64(v)) < BOUND[dt]
    gx, gb = ew.bias_gelu_backward(g, x, b)
    d = 0.5 * torch.special.erfc(-v / math.sqrt(2)) + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
    assert rel(gx, g.double() * d) < BOUND[dt]
    assert rel(gb, (g.double() * d).reshape(-1, h).sum(0)) < (2e-5 if dt == torch.float32 else 6e-3)
    assert torch.equal(ew.residual_add_forward(x, y), x + y)


@pytest.mark.parametrize("name", _launchers())
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_every_launcher_matches_float64(monkeypatch: pytest.MonkeyPatch, name: str, dt: torch.dtype) -> None:
    """Each launcher on the same cached decisions: twice per shape and offset (the second call reuses the packed
    arguments with new pointers), aligned and off by one element."""
    monkeypatch.setattr(launch, "LAUNCHER", name)
    monkeypatch.setattr(ew, "_CACHE", {})
    for shape in SHAPES:
        for off in (0, 1):
            check_all(dt, shape, off)
            check_all(dt, shape, off)
    assert ew._CACHE


def test_cached_launch_replays_in_a_graph() -> None:
    """A cached launch captured into a CUDA graph reads the inputs' current values at replay."""
    x, y = randn((256, 1024), torch.bfloat16), randn((256, 1024), torch.bfloat16)
    ew.residual_add_forward(x, y)  # decided and built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ew.residual_add_forward(x, y)
    for _ in range(2):
        x.copy_(randn(x.shape, x.dtype))
        y.copy_(randn(y.shape, y.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x + y)


@pytest.mark.parametrize("winner", [ct.PEERLINE, ct.TORCH])
def test_auto_follows_the_card_table_and_stays_right(monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    """--kernels auto with a mocked card entry: the chosen implementation runs (the kernel's Function or torch's
    ops), and forward and gradients match float64 either way."""
    table = ct.CardTable.from_entry(ew.card_name(DEV.index), {
        "choice": {f"{op}:{dt}": [[1, winner]] for op in ("bias_gelu_fwd", "bias_gelu_bwd", "residual_add")
                   for dt in ("bf16", "fp32")},
        "eager_torch_below": {op: 0 for op in ("bias_gelu_fwd", "bias_gelu_bwd", "residual_add")}})
    monkeypatch.setattr(ew, "card_table", lambda index: table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    x = randn((64, 768), torch.float32).requires_grad_()
    r = randn((64, 768), torch.float32).requires_grad_()
    b = torch.randn(768, device=DEV, requires_grad=True)
    out = ops.residual_add(r, ops.bias_gelu(x, b, "auto"), "auto")
    mine = winner == ct.PEERLINE
    assert type(out.grad_fn).__name__ == ("ResidualAddBackward" if mine else "AddBackward0")
    assert type(out.grad_fn.next_functions[1][0]).__name__ == ("BiasGeluBackward" if mine else "GeluBackward0")
    g = torch.randn_like(out)
    out.backward(g)
    x64, b64, r64 = (t.detach().double().requires_grad_() for t in (x, b, r))
    want = r64 + gelu64(x64 + b64)
    want.backward(g.double())
    assert rel(out.detach(), want.detach()) < 1e-5
    for got, ref in ((x.grad, x64.grad), (b.grad, b64.grad), (r.grad, r64.grad)):
        assert rel(got, ref) < 1e-5


def test_auto_eager_small_launch_builds_the_captured_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager below the threshold runs torch's op yet builds the kernel a captured launch of that size will use."""
    table = ct.CardTable.from_entry(ew.card_name(DEV.index), {"eager_torch_below": {"residual_add": 1 << 40}})
    monkeypatch.setattr(ew, "card_table", lambda index: table)
    monkeypatch.setattr(ew, "_CHOICES", {})
    monkeypatch.setattr(ew, "_warmed", set())
    x, y = randn((96, 640), torch.bfloat16), randn((96, 640), torch.bfloat16)
    assert torch.equal(ew.auto_residual_add(x, y), x + y)
    assert len(ew._warmed) == 1


@pytest.mark.parametrize("name", _launchers())
def test_launch_from_a_thread_without_a_current_context(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A thread whose first driver call is a peerline launch (autograd's backward worker can be one) gets the
    stream's context made current instead of CUDA_ERROR_INVALID_CONTEXT."""
    monkeypatch.setattr(launch, "LAUNCHER", name)
    x, y = randn((128, 1024), torch.float32), randn((128, 1024), torch.float32)
    ew.residual_add_forward(x, y)  # decided and built on this thread
    torch.cuda.synchronize()
    result: dict[str, object] = {}

    def work() -> None:
        try:
            result["out"] = ew.residual_add_forward(x, y)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["out"], x + y)
