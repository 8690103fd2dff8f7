"""Why the gpt suite's torch.compile'd anchor runs slower than eager: times one pipeline stage's worth of the plain
GPT (bench/suites/plain_gpt.py) on one GPU, forward + backward of M microbatches, blocks eager and compiled, with
torchtitan's complex RoPE and with a real-valued rotate-half RoPE, and prints dynamo's recompile / graph-break
counters for each. One GPU; INFO lines only.

    PYTHONPATH=$PWD TORCH_LOGS=recompiles,graph_breaks python3 tools/gpu_probes/compiled_anchor_probe.py
"""

from __future__ import annotations

import argparse

import torch

from peerline.bench.benchkit import time_fn
from peerline.bench.suites import plain_gpt


def rotate_half_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rotation in real arithmetic on the interleaved pairs (no complex tensors)."""
    t = xq.shape[1]
    cos = freqs_cis.real[:t].view(1, t, 1, -1).repeat_interleave(2, dim=-1).to(xq.dtype)
    sin = freqs_cis.imag[:t].view(1, t, 1, -1).repeat_interleave(2, dim=-1).to(xq.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))
        swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return x * cos + swapped * sin

    return rot(xq), rot(xk)


def time_stage(model: torch.nn.Module, x: torch.Tensor, microbatches: int, reps: int) -> float:
    """Median ms of `microbatches` forward + backward passes (a stage's work in one iteration)."""
    def once() -> None:
        for _ in range(microbatches):
            inp = x.detach().requires_grad_(True)
            model(inp).float().square().mean().backward()

    return time_fn(once, warmup=3, reps=reps).median_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default="eager,compiled",
                   help="blocks to time: eager, compiled, compiled-max-autotune-no-cudagraphs (minutes of autotuning)")
    a = p.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(1, a.seq, a.hidden, device=dev, dtype=torch.bfloat16)
    original = plain_gpt.apply_rotary_emb
    for rope in ("complex", "rotate-half"):
        plain_gpt.apply_rotary_emb = original if rope == "complex" else rotate_half_rope
        for blocks in a.modes.split(","):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            model = plain_gpt.PlainGPT(vocab=4096, hidden=a.hidden, heads=a.heads, layers=2 * a.blocks, seq=a.seq,
                                       start=1, stop=a.blocks + 1).to(dev, torch.bfloat16)
            if blocks != "eager":
                for name, block in list(model.layers.named_children()):
                    mode = "max-autotune-no-cudagraphs" if "autotune" in blocks else None
                    model.layers.register_module(name, torch.compile(block, fullgraph=True, mode=mode))
            ms = time_stage(model, x, a.microbatches, a.reps)
            c = torch._dynamo.utils.counters
            print(f"INFO rope={rope} blocks={blocks}: {ms:.2f} ms for {a.microbatches} fwd+bwd of {a.blocks} blocks; "
                  f"frames {dict(c['frames'])} recompiles {dict(c['recompiles'])} "
                  f"graph_breaks {sum(c['graph_break'].values())} stats {dict(c['stats'])}", flush=True)
    plain_gpt.apply_rotary_emb = original


if __name__ == "__main__":
    main()
