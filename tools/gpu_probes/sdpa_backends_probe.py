"""Which scaled-dot-product-attention backend is fastest for a GPT shape on this GPU: forward + backward of causal
attention, bf16, q / k / v as strided views of one packed [B, T, 3, H, D] tensor (the GPT's layout) and contiguous
[B, H, T, D], under each of torch's SDPA backends (flash, cuDNN, memory-efficient), against a float64 reference for
the error. One GPU; INFO lines only.

    PYTHONPATH=$PWD python3 tools/gpu_probes/sdpa_backends_probe.py [--seq 2048 --heads 16 --head-dim 128]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from peerline.bench.benchkit import time_fn

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    b, t, h, d = a.batch, a.seq, a.heads, a.head_dim
    qkv = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * b * h * t * t * d / 2 * 3.5  # causal: forward 2 GEMMs, backward 2.5x
    ref = None
    for layout in ("packed-views", "contiguous"):
        for name, backend in BACKENDS.items():
            leaf = qkv.clone().requires_grad_(True)

            def views(leaf: torch.Tensor = leaf, layout: str = layout) -> tuple[torch.Tensor, ...]:
                q, k, v = leaf.unbind(2)
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
                return tuple(x.contiguous() for x in (q, k, v)) if layout == "contiguous" else (q, k, v)

            def once(backend: SDPBackend = backend, views: Callable = views, leaf: torch.Tensor = leaf
                     ) -> torch.Tensor:
                leaf.grad = None  # each repetition writes fresh gradients, as a training step does
                with sdpa_kernel([backend]):
                    y = F.scaled_dot_product_attention(*views(), is_causal=True)
                y.backward(dout)
                return y

            try:
                y = once()
            except RuntimeError as e:
                print(f"INFO {layout} {name}: not available ({str(e).splitlines()[0][:160]})")
                continue
            if ref is None:
                q64, k64, v64 = (x.double() for x in qkv.unbind(2))
                ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q64, k64, v64)), is_causal=True)
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            ms = time_fn(once, warmup=3, reps=a.reps).median_ms
            print(f"INFO {layout} {name}: fwd+bwd {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, max rel err vs fp64 "
                  f"{err:.2e}", flush=True)


if __name__ == "__main__":
    main()
