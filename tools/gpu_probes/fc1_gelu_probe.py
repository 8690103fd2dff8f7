"""Device time of an MLP's first Linear and its GELU, forward + backward, three ways, at the shapes the benches run:

  torch       z = F.linear(x, W, b) (the bias in the GEMM's epilogue), F.gelu(z): what nn.Linear + GELU runs
  split       z = F.linear(x, W) (no bias), peerline's bias_gelu(z, b): the block's per-op path today
  epilogue    z = F.linear(x, W, b), peerline's bias_gelu(z, 0): the bias back in the epilogue, the fused GELU kept

the forward GEMM alone with and without the bias epilogue (cuBLAS picks its kernel by both), and the GELU's
elementwise passes alone on the GEMM's output: peerline's fused bias+GELU forward and backward (the backward with
its bias-gradient reduction) against torch's GELU forward and its backward plus the bias gradient's sum, as torch
runs them after a GEMM with the bias in its epilogue. Each timing is
the median over repetitions of CUDA events around `--iters` back-to-back passes, the variants rotated per
repetition. bf16 throughout. On the CPU the peerline kernel is the torch reference (what the unit test runs).

How a pass runs, on a GPU: eager launches (default: the inputs are hot in L2 from the previous pass, as a GEMM's
output is for the op after it); `--graph`, each variant captured once in a CUDA graph and replayed (no host time
in the figure); `--flush-l2`, each pass timed alone after writing twice the L2's bytes elsewhere (cold inputs: how
the kernels suite and the card tune time the elementwise kernels).

    PYTHONPATH=$PWD python3 tools/gpu_probes/fc1_gelu_probe.py [--shapes 4096x2048,4096x4096] [--graph] [--flush-l2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from graph_timing import captured

from peerline.kernels.reference import bias_gelu_reference


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x2048,2048x2048,4096x4096,8192x1536",
                   help="TOKENSxHIDDEN list; the Linear maps HIDDEN to 4 x HIDDEN (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="passes per timed repetition (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions, after one warm-up (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                   help="default: %(default)s")
    p.add_argument("--graph", action="store_true", help="replay each variant captured in a CUDA graph (GPU only)")
    p.add_argument("--flush-l2", action="store_true",
                   help="time each pass alone after evicting the L2 (GPU only; see above)")
    return p.parse_args(argv)


def _peerline_ops(device: torch.device) -> tuple[Callable, Callable, Callable]:
    """peerline's bias_gelu (its autograd Function), fused bias+GELU forward and fused backward; on the CPU,
    torch's reference of each."""
    if device.type == "cuda":
        from peerline.kernels.elementwise import bias_gelu, bias_gelu_backward, bias_gelu_forward

        return bias_gelu, bias_gelu_forward, bias_gelu_backward

    def backward(dy: torch.Tensor, z: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gz = torch.ops.aten.gelu_backward(dy, z + b)
        return gz, gz.sum(0)

    return bias_gelu_reference, bias_gelu_reference, backward


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
             ) -> dict[str, Callable[[], object]]:
    """name -> one pass: the three forward + backward ways, the forward GEMM with and without its bias, and the
    GELU's elementwise passes alone (peerline's, torch's)."""
    bias_gelu, fused_forward, fused_backward = _peerline_ops(x.device)
    with torch.no_grad():
        z = F.linear(x, w)
        zb = z + b
    zero = torch.zeros_like(b)
    inputs = (x, w, b)

    def torch_way() -> object:
        return torch.autograd.grad(F.gelu(F.linear(x, w, b)), inputs, dy)

    def split_way() -> object:
        return torch.autograd.grad(bias_gelu(F.linear(x, w), b), inputs, dy)

    def epilogue_way() -> object:
        return torch.autograd.grad(bias_gelu(F.linear(x, w, b), zero), inputs, dy)

    def gemm_bias() -> object:
        with torch.no_grad():
            return F.linear(x, w, b)

    def gemm_plain() -> object:
        with torch.no_grad():
            return F.linear(x, w)

    def gelu_fwd_ours() -> object:
        return fused_forward(z, b)

    def gelu_fwd_torch() -> object:
        return F.gelu(zb)

    def gelu_bwd_ours() -> object:
        return fused_backward(dy, z, b)

    def gelu_bwd_torch() -> object:
        gz = torch.ops.aten.gelu_backward(dy, zb)
        return gz, gz.sum(0)

    return {"torch": torch_way, "split": split_way, "epilogue": epilogue_way, "gemm+bias fwd": gemm_bias,
            "gemm fwd": gemm_plain, "gelu fwd ours": gelu_fwd_ours, "gelu fwd torch": gelu_fwd_torch,
            "gelu bwd ours": gelu_bwd_ours, "gelu bwd torch": gelu_bwd_torch}


def _cold_pass_ms(fn: Callable[[], object], scratch: torch.Tensor) -> float:
    """One pass timed alone, after writing `scratch` (twice the L2) evicts its inputs."""
    scratch.add_(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_variants(fns: dict[str, Callable[[], object]], iters: int, reps: int, device: torch.device,
                  scratch: torch.Tensor | None = None) -> dict[str, float]:
    """name -> median ms per pass; the variants rotate within each repetition. With `scratch` (a GPU), each pass
    is timed alone with cold inputs (_cold_pass_ms)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps + 1):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            fn = fns[name]
            if scratch is not None:
                ms = sum(_cold_pass_ms(fn, scratch) for _ in range(iters))
            elif device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                ms = (time.perf_counter() - t0) * 1e3
            if rep:
                times[name].append(ms / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu and (args.graph or args.flush_l2):
        print("INFO --graph and --flush-l2 need a GPU: eager timings on the CPU", flush=True)
    scratch = None
    if on_gpu and args.flush_l2:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        scratch = torch.zeros(2 * l2 // 4, device=device)
    mode = ("graph" if on_gpu and args.graph else "eager") + (", cold L2" if scratch is not None else "")
    out: dict[str, dict[str, float]] = {}
    for shape in args.shapes.split(","):
        tokens, hidden = (int(v) for v in shape.lower().split("x"))
        gen = torch.Generator(device=device).manual_seed(tokens * 7 + hidden)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        w = (torch.randn(4 * hidden, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5
             ).requires_grad_(True)
        b = (torch.randn(4 * hidden, device=device, dtype=dtype, generator=gen) * 0.1).requires_grad_(True)
        dy = torch.randn(tokens, 4 * hidden, device=device, dtype=dtype, generator=gen)
        fns = variants(x, w, b, dy)
        if on_gpu and args.graph:
            fns = {k: captured(fn) for k, fn in fns.items()}
        got = time_variants(fns, args.iters, args.reps, device, scratch)
        out[shape] = got
        base = got["torch"]
        print(f"INFO {shape} ({dtype}, {device}, {mode}): " + ", ".join(
            f"{k} {v:.4f} ms" + (f" ({base / v:.3f}x torch)" if k in ("split", "epilogue") else "")
            for k, v in got.items()) + f"; GELU passes: forward {got['gelu fwd torch'] / got['gelu fwd ours']:.3f}x, "
              f"backward {got['gelu bwd torch'] / got['gelu bwd ours']:.3f}x torch's", flush=True)
    return out


if __name__ == "__main__":
    main()
