"""Per-launch host time of peerline's elementwise ops and of torch's equivalents, eager.

Only the host counts: a long spin kernel (torch.cuda._sleep) is queued first, so every launch of the timed loop goes
into a queue the GPU has not reached and nothing waits on the device; the loop's wall time over its calls is the
host cost of one call. Each figure is the median over `reps` loops. Used by the hostcost suite
(bench/suites/hostcost.py) and the tuner (tune.py, the eager thresholds of kernels/card_plans.json).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from peerline.bench.kernel_tools import common

SPIN_CYCLES = 60_000_000  # ~30 ms at 2 GHz: longer than one timed loop's launches take the host
CALLS = 100


def host_us(fn: Callable[[], object], device: torch.device, calls: int = CALLS, reps: int = 7) -> float:
    """Median microseconds of host time per call of `fn` (the GPU kept busy; the CPU: plain wall time)."""
    on_cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    if on_cuda:
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def op_pairs(dtype: torch.dtype, rows: int, hidden: int, device: torch.device, impl: str = "peerline"
             ) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """case -> (peerline call, torch's equivalent call), eager: the autograd forwards (inputs that need grad, as in
    training), the raw launches (no autograd) and the backward ops. `impl` "auto" times ops.* with --kernels auto."""
    from peerline.kernels import elementwise as ew
    from peerline.kernels import ops

    x = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_()
    y = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_()
    b = torch.randn(hidden, device=device).requires_grad_()
    g = torch.randn(rows, hidden, device=device).to(dtype)
    xd, yd, bd, bx = x.detach(), y.detach(), b.detach(), b.detach().to(dtype)
    v = xd + bx
    gelu = (lambda: ops.bias_gelu(x, b, impl)) if impl != "peerline" else (lambda: ew.bias_gelu(x, b))
    add = (lambda: ops.residual_add(x, y, impl)) if impl != "peerline" else (lambda: ew.residual_add(x, y))
    return {
        "bias_gelu fwd (autograd)": (gelu, lambda: F.gelu(x + b.to(dtype))),
        "residual_add fwd (autograd)": (add, lambda: x + y),
        "bias_gelu fwd (raw launch)": (lambda: ew.bias_gelu_forward(xd, bd), lambda: F.gelu(xd + bx)),
        "residual_add fwd (raw launch)": (lambda: ew.residual_add_forward(xd, yd), lambda: xd + yd),
        "bias_gelu bwd (raw launch)": (lambda: ew.bias_gelu_backward(g, xd, bd), lambda: common.torch_gelu_bwd(g, v)),
    }


def autograd_backward_pairs(dtype: torch.dtype, rows: int, hidden: int, device: torch.device
                            ) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Forward + backward through autograd (one op each), peerline's Function against torch's ops."""
    from peerline.kernels import elementwise as ew

    x = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_()
    y = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_()
    b = torch.randn(hidden, device=device).requires_grad_()
    g = torch.randn(rows, hidden, device=device).to(dtype)

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        return lambda: fn().backward(g)

    return {
        "bias_gelu fwd+bwd (autograd)": (run(lambda: ew.bias_gelu(x, b)), run(lambda: F.gelu(x + b.to(dtype)))),
        "residual_add fwd+bwd (autograd)": (run(lambda: ew.residual_add(x, y)), run(lambda: x + y)),
    }


def launcher_costs(device: torch.device, rows: int = 512, hidden: int = 512) -> dict[str, float]:
    """Host microseconds of one raw residual add launch through each launcher (kernels/launch.py) that works here,
    and torch's x + y: what the launcher choice is worth."""
    from peerline.kernels import elementwise as ew
    from peerline.kernels import launch

    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    out = {"torch x + y": host_us(lambda: x + y, device)}
    saved = launch.LAUNCHER
    try:
        for name in launch.LAUNCHERS[1:]:
            try:
                launch.LAUNCHER = name
                out[f"peerline via {name}"] = host_us(lambda: ew.residual_add_forward(x, y), device)
            except Exception as exc:  # noqa: BLE001 - a launcher this machine lacks (a package, libcuda)
                out[f"peerline via {name}"] = float("nan")
                out[f"peerline via {name}: {type(exc).__name__}"] = float("nan")
    finally:
        launch.LAUNCHER = saved
    return out
