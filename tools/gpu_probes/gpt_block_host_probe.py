"""Host time per call of one GPT block, forward + backward with bf16 weights: peerline's GPTBlock with
`--kernels auto` and with `--kernels torch`, and the plain torch GPT's TransformerBlock (the gpt suite's anchor),
then peerline auto's forward part by part (norm, qkv, RoPE attention, proj, residual add, fc1 + bias + GELU, fc2).

The shape is small (the launch-bound GPT's by default), so the device never falls behind and each figure is the
host's cost: where an eager iteration spends its host time when the device waits for it. peerline's calls run
inside `eager_only()`, as the runtime runs an eager iteration.

    PYTHONPATH=$PWD python3 tools/gpu_probes/gpt_block_host_probe.py [--hidden 256 --heads 4 --seq 256 --batch 2]
    (--device cpu runs the same calls on the CPU: a check that the probe runs, not a figure of a GPU)
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import torch
from auto_host_probe import per_call_us as host_us  # a sibling script (its folder is on sys.path)

from peerline.bench.suites.plain_gpt import TransformerBlock, precompute_freqs_cis
from peerline.kernels import ops
from peerline.kernels.capture_state import eager_only
from peerline.kernels.rope import rope_attention
from peerline.models.gpt import GPTBlock

log = logging.getLogger("gpt_block_host_probe")


def per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """auto_host_probe's host time per call (median of 5 rounds) after one untimed call, which loads and compiles
    what the call needs."""
    fn()
    return host_us(fn, calls, torch.cuda.synchronize if device.type == "cuda" else lambda: None)


def peerline_block(hidden: int, heads: int, impl: str, seq: int, device: torch.device) -> GPTBlock:
    """peerline's block with bf16 parameters and its RoPE tables left fp32, as the runtime casts it (the fused RoPE
    kernel reads fp32 tables)."""
    block = GPTBlock(hidden, heads, impl, max_seq=seq).to(device)
    for p in block.parameters():
        p.data = p.data.to(torch.bfloat16)
    return block


def probe(hidden: int, heads: int, seq: int, batch: int, calls: int, device: torch.device) -> dict[str, float]:
    """Every figure, microseconds per call, by name."""
    dtype = torch.bfloat16
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    got: dict[str, float] = {}
    blocks = {impl: peerline_block(hidden, heads, impl, seq, device) for impl in ("auto", "torch")}
    for impl, block in blocks.items():
        def step(block: GPTBlock = block) -> None:
            with eager_only():
                block(x).sum().backward()
        got[f"peerline GPTBlock {impl} fwd+bwd"] = per_call_us(step, calls, device)
    plain = TransformerBlock(hidden, heads).to(device, dtype)
    freqs = precompute_freqs_cis(hidden // heads, seq).to(device)
    got["plain TransformerBlock fwd+bwd"] = per_call_us(lambda: plain(x, freqs).sum().backward(), calls, device)

    b = blocks["auto"]
    h = b.norm1(x)
    qkv = b.qkv(h)
    y = rope_attention(qkv, b.rope_cos, b.rope_sin, b.heads, "auto", b.attention_impl)
    parts: dict[str, Callable[[], object]] = {
        "norm": lambda: b.norm1(x),
        "qkv": lambda: b.qkv(h),
        "rope attention": lambda: rope_attention(qkv, b.rope_cos, b.rope_sin, b.heads, "auto", b.attention_impl),
        "proj": lambda: b.proj(y),
        "residual add": lambda: ops.residual_add(x, h, "auto"),
        "fc1 + bias + gelu": lambda: ops.linear_bias_gelu(b.fc1, h, b.fc1_bias, "auto"),
        "fc2": lambda: b.fc2(ops.linear_bias_gelu(b.fc1, h, b.fc1_bias, "auto")),
    }
    for name, fn in parts.items():
        def under_eager(fn: Callable[[], object] = fn) -> object:
            with eager_only():
                return fn()
        got[f"peerline auto fwd part: {name}"] = per_call_us(under_eager, calls, device)
    return got


def host_profiles(hidden: int, heads: int, seq: int, batch: int, device: torch.device) -> dict[str, str]:
    """torch.profiler's table of host ops by self CPU time, 20 forward + backward calls, per block."""
    dtype = torch.bfloat16
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    block = peerline_block(hidden, heads, "auto", seq, device)
    plain = TransformerBlock(hidden, heads).to(device, dtype)
    freqs = precompute_freqs_cis(hidden // heads, seq).to(device)

    def ours() -> None:
        with eager_only():
            block(x).sum().backward()

    def theirs() -> None:
        plain(x, freqs).sum().backward()

    out = {}
    for name, fn in (("peerline GPTBlock auto", ours), ("plain TransformerBlock", theirs)):
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                fn()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's host ops by self CPU "
                        "time for peerline's block (auto) and the plain block, forward + backward")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="INFO %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU"
    log.info("%s, torch %s: GPT block hidden %d, %d heads, %d x %d tokens, bf16 weights, %d calls per round", name,
             torch.__version__, args.hidden, args.heads, args.batch, args.seq, args.calls)
    for what, us in probe(args.hidden, args.heads, args.seq, args.batch, args.calls, device).items():
        log.info("%-45s %9.1f us", what, us)
    if args.profile:
        for what, table in host_profiles(args.hidden, args.heads, args.seq, args.batch, device).items():
            log.info("%s: host ops by self CPU time over 20 calls\n%s", what, table)


if __name__ == "__main__":
    main()
