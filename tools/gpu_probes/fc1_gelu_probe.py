"""Device time of an MLP's first Linear and its GELU, forward + backward, three ways, at the shapes the benches run:

  torch       z = F.linear(x, W, b) (the bias in the GEMM's epilogue), F.gelu(z): what nn.Linear + GELU runs
  split       z = F.linear(x, W) (no bias), peerline's bias_gelu(z, b): the block's per-op path today
  epilogue    z = F.linear(x, W, b), peerline's bias_gelu(z, 0): the bias back in the epilogue, the fused GELU kept

and the forward GEMM alone with and without the bias epilogue (cuBLAS picks its kernel by both). Each timing is
the median over repetitions of CUDA events around `--iters` back-to-back passes, the variants rotated per
repetition. bf16 throughout. On the CPU the peerline kernel is the torch reference (what the unit test runs).

    PYTHONPATH=$PWD python3 tools/gpu_probes/fc1_gelu_probe.py [--shapes 4096x2048,4096x4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

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
    return p.parse_args(argv)


def _bias_gelu(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if device.type == "cuda":
        from peerline.kernels.elementwise import bias_gelu

        return bias_gelu
    return bias_gelu_reference


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
             ) -> dict[str, Callable[[], object]]:
    """name -> one pass: the three forward + backward ways, and the forward GEMM with and without its bias."""
    bias_gelu = _bias_gelu(x.device)
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

    return {"torch": torch_way, "split": split_way, "epilogue": epilogue_way, "gemm+bias fwd": gemm_bias,
            "gemm fwd": gemm_plain}


def time_variants(fns: dict[str, Callable[[], object]], iters: int, reps: int, device: torch.device
                  ) -> dict[str, float]:
    """name -> median ms per pass; the variants rotate within each repetition."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps + 1):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            fn = fns[name]
            if device.type == "cuda":
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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, dict[str, float]] = {}
    for shape in args.shapes.split(","):
        tokens, hidden = (int(v) for v in shape.lower().split("x"))
        gen = torch.Generator(device=device).manual_seed(tokens * 7 + hidden)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        w = (torch.randn(4 * hidden, hidden, device=device, dtype=dtype, generator=gen) * hidden ** -0.5
             ).requires_grad_(True)
        b = (torch.randn(4 * hidden, device=device, dtype=dtype, generator=gen) * 0.1).requires_grad_(True)
        dy = torch.randn(tokens, 4 * hidden, device=device, dtype=dtype, generator=gen)
        got = time_variants(variants(x, w, b, dy), args.iters, args.reps, device)
        out[shape] = got
        base = got["torch"]
        print(f"INFO {shape} ({dtype}, {device}): " + ", ".join(
            f"{k} {v:.4f} ms" + (f" ({base / v:.3f}x torch)" if k in ("split", "epilogue") else "")
            for k, v in got.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
