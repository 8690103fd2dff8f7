"""Host time per call of `--kernels auto`'s eager choices against calling torch's op directly (one GPU).

Times, in microseconds per call on the host (the device work is tiny, so the queue never fills):
  - torch.cuda.is_current_stream_capturing() on a side stream, the capture check every auto launch makes;
  - ops.bias_gelu and ops.residual_add with impl "auto" and "torch";
  - FusedLinear's forward with impl "auto" and "torch" (bf16 weights: auto's eager rule runs F.linear);
  - the residual-MLP block's forward + backward with each impl.

    PYTHONPATH=$PWD python3 tools/gpu_probes/auto_host_probe.py [--hidden 512 --tokens 512 --calls 2000]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

from peerline.distributed.model import ResidualMLPBlock
from peerline.kernels import ops
from peerline.kernels.fused_linear import FusedLinear

log = logging.getLogger("auto_host_probe")


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], object] = torch.cuda.synchronize) -> float:
    """Median over 5 rounds of the host time per call (the device is synchronized before each round only, by
    `sync`)."""
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return sorted(rounds)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="INFO %(message)s")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    side = torch.cuda.Stream()
    h, n = args.hidden, args.calls
    with torch.cuda.stream(side):
        x = torch.randn(args.tokens, 4 * h, device=dev, dtype=torch.bfloat16)
        b = torch.randn(4 * h, device=dev)
        r = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)
        log.info("%s, torch %s: hidden %d, %d tokens, %d calls per round", torch.cuda.get_device_name(dev),
                 torch.__version__, h, args.tokens, n)
        log.info("is_current_stream_capturing: %.2f us", per_call_us(torch.cuda.is_current_stream_capturing, n))
        for impl in ("torch", "auto"):
            log.info("bias_gelu %-5s: %.2f us", impl, per_call_us(lambda impl=impl: ops.bias_gelu(x, b, impl), n))
            log.info("residual_add %-5s: %.2f us", impl, per_call_us(lambda impl=impl: ops.residual_add(r, r, impl), n))
        for impl in ("torch", "auto"):
            lin = FusedLinear(h, 4 * h, impl=impl).to(dev, torch.bfloat16)
            with torch.no_grad():
                log.info("FusedLinear fwd %-5s (no grad): %.2f us", impl, per_call_us(lambda lin=lin: lin(r), n))
            log.info("FusedLinear fwd %-5s (grad): %.2f us", impl, per_call_us(lambda lin=lin: lin(r), n))
        for impl in ("torch", "auto"):
            block = ResidualMLPBlock(h, impl).to(dev, torch.bfloat16)
            inp = r.clone().requires_grad_(True)

            def step(block: torch.nn.Module = block, inp: torch.Tensor = inp) -> None:
                block(inp).sum().backward()

            log.info("MLP block fwd+bwd %-5s: %.2f us", impl, per_call_us(step, max(n // 10, 20)))
        # the same with the capture check answered by Python: how much of auto's cost the check is
        real = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: False
        try:
            log.info("bias_gelu auto, no capture check: %.2f us", per_call_us(lambda: ops.bias_gelu(x, b, "auto"), n))
            log.info("MLP block fwd+bwd auto, no capture check: %.2f us", per_call_us(step, max(n // 10, 20)))
        finally:
            torch.cuda.is_current_stream_capturing = real


if __name__ == "__main__":
    main()
