"""How fast the loss of one microbatch runs on one GPU: bf16 logits [rows, vocab] -> mean cross-entropy, forward
and backward, each way captured in a CUDA graph and replayed: torch's F.cross_entropy on an fp32 copy (what a plain
torch model runs), the chunked torch path (`--kernels torch`) and the fused kernels (cross_entropy.cu, the default
on a GPU). INFO lines: ms per forward + backward (median of --reps blocks of --steps replays) and the rate of the
fused kernels' traffic (the logits read twice, the gradient written once).

    python tools/gpu_probes/cross_entropy_probe.py [--shapes 4096x4096,4096x32000,8192x128256 --steps 20 --reps 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from graph_timing import replayed_ms

from peerline.kernels.cross_entropy import cross_entropy


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--shapes", default="4096x4096,4096x32000,8192x128256", help="ROWSxVOCAB,... (default %(default)s)")
    a.add_argument("--steps", type=int, default=20)
    a.add_argument("--reps", type=int, default=7)
    args = a.parse_args()
    ways = {"torch F.cross_entropy(fp32 copy)": lambda x, t: F.cross_entropy(x.float(), t),
            "chunked torch ops": lambda x, t: cross_entropy(x, t, impl="torch"),
            "fused kernels": lambda x, t: cross_entropy(x, t)}
    for shape in args.shapes.split(","):
        rows, vocab = (int(v) for v in shape.split("x"))
        logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16).requires_grad_(True)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        for name, loss_of in ways.items():
            def step(loss_of=loss_of, x=logits, t=target) -> None:
                x.grad = None
                loss_of(x, t).backward()
            ms = replayed_ms(step, args.steps, args.reps)
            rate = 3 * 2 * rows * vocab / ms / 1e6  # bytes per ms -> GB/s
            extra = f"; {rate:.0f} GB/s" if name == "fused kernels" else ""
            print(f"INFO {rows} x {vocab}: {name}: {ms:.3f} ms forward + backward{extra}", flush=True)
        logits = step = None
        torch.cuda.empty_cache()
    print(f"INFO {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
