"""How fast the token embedding's backward runs on one GPU: torch's (sort-based) against kernels/embedding.cu's
scan, each captured in a CUDA graph and replayed, for vocabularies and token counts on both sides of the kernel's
SCAN_LIMIT (where embedding.py hands over to torch). INFO lines: ms per weight gradient, median of --reps blocks of
--steps replays.

    python tools/gpu_probes/embedding_probe.py [--shapes 4096x4096x4096,32000x4096x4096 --steps 20 --reps 7]
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import replayed_ms

from peerline.kernels.embedding import SCAN_LIMIT, embedding_backward


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--shapes", default="4096x4096x4096,4096x8192x4096,16384x4096x4096,32000x4096x4096,"
                                       "128256x4096x4096", help="VOCABxTOKENSxHIDDEN,... (default %(default)s)")
    a.add_argument("--steps", type=int, default=20)
    a.add_argument("--reps", type=int, default=7)
    args = a.parse_args()
    for shape in args.shapes.split(","):
        vocab, tokens, hidden = (int(v) for v in shape.split("x"))
        ids = torch.randint(0, vocab, (tokens,), device="cuda")
        grad = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        out = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="cuda")
        ways = {"torch": lambda i=ids, g=grad, v=vocab: torch.ops.aten.embedding_dense_backward(g, i, v, -1, False),
                "kernel": lambda i=ids, g=grad, v=vocab, o=out: embedding_backward(i, g, v, out=o)}
        side = "within" if vocab * tokens <= SCAN_LIMIT else "past"
        for name, way in ways.items():
            ms = replayed_ms(way, args.steps, args.reps)
            print(f"INFO V {vocab} x {tokens} tokens x H {hidden} ({side} SCAN_LIMIT): {name} {ms:.3f} ms", flush=True)
    print(f"INFO {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
