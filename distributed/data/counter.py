"""Counter-based synthetic data (`--data counter`): each element is a pure function of (seed, iteration, global
microbatch, stream, element index), with the iteration read from a device-side counter.

Why: the default synthetic data (`--data seeded`, model.fill_batch) reseeds torch's generator per buffer on the host,
two calls per buffer and iteration, tens of microseconds of host time per iteration (docs/benchmarks/code-notes.md).
Data made from a counter needs no host work: a captured iteration generates its own inputs from the counter and
advances it, so a looped graph (cudagraph/loop.py) runs K iterations, data included, from one host launch.

The integer hash is splitmix64's finalizer; the normal is Box-Muller on two 24-bit uniforms in fp32. On a GPU one
NVRTC kernel (kernels/counter_data.cu) writes a buffer; on the CPU (and as the GPU's test reference) the same
arithmetic runs as torch int64 ops, bitwise equal in the integer part (libm differences only in the float part).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# peerline/distributed/data/counter.py -> peerline/kernels (the same layout in the checkout and when installed)
KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "counter_data.cu"
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_THREADS = 256


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (unsigned 64-bit arithmetic)."""
    z &= MASK64
    z ^= z >> 30
    z = (z * _M1) & MASK64
    z ^= z >> 27
    z = (z * _M2) & MASK64
    return z ^ (z >> 31)


def host_constants(seed: int, global_mb: int, stream: int) -> tuple[int, int]:
    """(seed_mix, salt) of one buffer, as unsigned 64-bit ints; the device combines them with the iteration."""
    return mix64(seed), ((2 * global_mb + stream + 1) * GOLDEN) & MASK64


def _signed(v: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (torch has no uint64 arithmetic on every device)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr(z, 30)
    z = z * _signed(_M1)  # int64 multiplication wraps: the low 64 bits of the unsigned product
    z = z ^ _shr(z, 27)
    z = z * _signed(_M2)
    return z ^ _shr(z, 31)


def reference_fill(out: torch.Tensor, seed: int, iteration: torch.Tensor, global_mb: int, stream: int) -> None:
    """Torch ops on out's device: out <- the counter-based normals (CPU path; the GPU kernel's test reference)."""
    seed_mix, salt = host_constants(seed, global_mb, stream)
    it = iteration.reshape(()).to(device=out.device, dtype=torch.int64)
    key = _mix64_tensor(_mix64_tensor(torch.bitwise_xor(it * _signed(GOLDEN), _signed(seed_mix)))
                        ^ _signed(salt))
    idx = torch.arange(1, out.numel() + 1, device=out.device, dtype=torch.int64)
    h = _mix64_tensor(key + idx * _signed(GOLDEN))
    scale = 2.0 ** -24
    u1 = (_shr(h, 40).to(torch.float32) + 0.5) * scale
    u2 = ((_shr(h, 16) & 0xFFFFFF).to(torch.float32) + 0.5) * scale
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    out.copy_(z.view(out.shape))


def fill(out: torch.Tensor, seed: int, iteration: torch.Tensor, global_mb: int, stream: int) -> None:
    """out <- the counter-based normals of (seed, iteration[0], global_mb, stream), on the current stream: one
    kernel on a GPU (capturable: nothing but a launch), torch ops on the CPU."""
    if out.device.type != "cuda":
        reference_fill(out, seed, iteration, global_mb, stream)
        return
    if out.dtype != torch.float32 or not out.is_contiguous() or iteration.dtype != torch.int64:
        raise ValueError("counter data fills contiguous float32 buffers from an int64 iteration counter")
    from peerline.kernels.compile import load_kernel
    from peerline.kernels.elementwise import launch_raw

    seed_mix, salt = host_constants(seed, global_mb, stream)
    n = out.numel()
    grid = max(1, min(-(-n // _THREADS), 4096))
    kernel, _ = load_kernel(KERNEL_SOURCE, "pl_counter_normal", out.device.index)
    launch_raw(kernel, grid, _THREADS, "pqppp", (out.data_ptr(), n, seed_mix, salt, iteration.data_ptr()),
               out.device)
