"""How fast the AdamW step over bf16 parameters runs on one GPU: torch's fused AdamW (capturable, bf16 moments: 14
bytes of memory traffic per parameter) and the same stepping through our kernel (what `--precision bf16` runs,
FusedBf16AdamW) against compact AdamW's one multi-tensor kernel
(`--precision compact`: 18 bytes) and MasterAdamW's (`--precision master`: 28), and MasterAdamW's chunked torch ops
(its CPU path: the gradients upcast into fp32 scratch, torch's fused AdamW, a copy back; about 40 bytes), each
step captured in a CUDA graph and replayed. The parameters are one pipeline rank's of the GPT (--layers blocks of
--hidden, biases and LayerNorms, plus an embedding of --vocab rows). INFO lines: ms per step (median of --reps
blocks of --steps replays) and the memory traffic's rate.

    python tools/gpu_probes/adamw_probe.py [--layers 4 --hidden 4096 --vocab 4096 --steps 10 --reps 7]
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import replayed_ms

from peerline.distributed.grad_sync.compact_adamw import CompactAdamW
from peerline.distributed.grad_sync.fused_bf16_adamw import FusedBf16AdamW
from peerline.distributed.grad_sync.master_adamw import MasterAdamW

BYTES = {"torch fused (bf16)": 14, "fused bf16, our kernel": 14, "compact": 18, "master": 28,
         "master, chunked torch ops": 40}


class ChunkedMasterAdamW(MasterAdamW):
    """MasterAdamW stepping through its chunked torch ops on the GPU too."""

    def _update(self, found_inf: torch.Tensor | None) -> None:
        self._step_chunks(found_inf)


def rank_params(layers: int, hidden: int, vocab: int) -> list[torch.nn.Parameter]:
    """A GPT pipeline rank's parameter shapes, bf16 on the GPU, with bf16 gradients."""
    h = hidden
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn_like(p) * 1e-3
        params.append(p)
    return params


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--hidden", type=int, default=4096)
    a.add_argument("--vocab", type=int, default=4096)
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--reps", type=int, default=7)
    args = a.parse_args()
    makers = {
        "torch fused (bf16)": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-4, device="cuda"), fused=True,
                                                           capturable=True),
        "fused bf16, our kernel": lambda ps: FusedBf16AdamW(ps, lr=1e-4),
        "compact": lambda ps: CompactAdamW(ps, lr=1e-4),
        "master": lambda ps: MasterAdamW(ps, lr=1e-4),
        "master, chunked torch ops": lambda ps: ChunkedMasterAdamW(ps, lr=1e-4),
    }
    n = None
    for name, make in makers.items():
        params = rank_params(args.layers, args.hidden, args.vocab)
        n = sum(p.numel() for p in params)
        ms = replayed_ms(make(params).step, args.steps, args.reps)
        rate = BYTES[name] * n / ms / 1e6  # bytes per ms -> GB/s
        print(f"INFO {name}: {ms:.3f} ms per step over {n / 1e6:.1f} M parameters in {len(params)} tensors; "
              f"{BYTES[name]} bytes per parameter -> {rate:.0f} GB/s", flush=True)
        del params
        torch.cuda.empty_cache()
    print(f"INFO {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
