"""Time one pipeline stage's compute with nn.Linear + autocast against the fused linear (kernels/fused_linear.py):
8 blocks of h=2048 (one stage of the 16-block compute-bound pipeline), M=8 microbatches of 8x512 tokens, bf16
autocast, each microbatch's forward then backward (1F1B's steady state), gradients accumulated in fp32 .grad.
Same-process, same-GPU, alternating runs; median of CUDA-event timings. Prints one GOAL line.
Run: python3 tools/gpu_probes/fused_linear_bench.py [--blocks 8 --hidden 2048 --reps 5]"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn

from peerline.distributed.model import ResidualMLPBlock
from peerline.kernels import fused_linear


def build(blocks: int, hidden: int, impl: str, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[ResidualMLPBlock(hidden, "torch") for _ in range(blocks)]).to(device)
    for b in model:  # only the linears differ between the two runs
        b.fc1.impl = b.fc2.impl = impl
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def iteration(model: nn.Sequential, xs: list[torch.Tensor], dy: torch.Tensor) -> None:
    fused_linear.new_iteration()
    for p in model.parameters():
        p.grad.zero_()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # one region per iteration, as the engine has
        for x in xs:
            y = model(x)
            with torch.autocast("cuda", enabled=False):
                y.backward(dy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    xs = [torch.randn(a.micro_batch, a.seq, a.hidden, device=dev) for _ in range(a.microbatches)]
    dy = torch.randn(a.micro_batch, a.seq, a.hidden, device=dev)
    models = {impl: build(a.blocks, a.hidden, impl, dev) for impl in ("torch", "peerline")}
    times: dict[str, list[float]] = {impl: [] for impl in models}
    print(f"INFO probe addmm.dtype_out: {fused_linear.probe(dev)}", flush=True)
    for rep in range(a.reps + 2):
        for impl, model in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            iteration(model, xs, dy)
            end.record()
            end.synchronize()
            if rep >= 2:  # two warm-up iterations each
                times[impl].append(start.elapsed_time(end))
    med = {impl: statistics.median(t) for impl, t in times.items()}
    spread = {impl: (min(t), max(t)) for impl, t in times.items()}
    n_params = sum(p.numel() for p in models["torch"].parameters())
    g_ref = [p.grad for p in models["torch"].parameters()]
    g_new = [p.grad for p in models["peerline"].parameters()]
    worst = max(((a_ - b_).abs().max() / b_.abs().max().clamp_min(1e-12)).item() for a_, b_ in zip(g_new, g_ref))
    print(f"INFO {a.blocks} blocks h={a.hidden} ({n_params / 1e6:.0f} M params), M={a.microbatches} x "
          f"{a.micro_batch}x{a.seq}; nn.Linear {med['torch']:.2f} ms [{spread['torch'][0]:.2f}, "
          f"{spread['torch'][1]:.2f}], fused {med['peerline']:.2f} ms [{spread['peerline'][0]:.2f}, "
          f"{spread['peerline'][1]:.2f}]; grads max relative difference {worst:.2e}")
    ratio = med["torch"] / med["peerline"]
    print(f"GOAL fused_linear.stage_fwd_bwd: nn.Linear {med['torch']:.2f} ms, fused {med['peerline']:.2f} ms per "
          f"iteration, speedup {ratio:.3f}x (goal > 1; saved {med['torch'] - med['peerline']:.2f} ms per stage)")
    print(f"{'PASS' if worst < 5e-2 else 'FAIL'} fused_linear.bench_grads (max relative difference {worst:.2e})")


if __name__ == "__main__":
    main()
