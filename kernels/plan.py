"""Launch planning for the elementwise kernels: pure Python, no CUDA, so the CPU tests can check it.

Vocabulary (the same as elementwise.cu):
  E       elements per chunk: 16 bytes of the narrowest streamed operand, so every operand's chunk is whole
          16-byte vectors (bf16 present -> 8, all fp32 -> 4)
  head    scalar elements before the 16-byte-aligned body; every streamed pointer must become aligned after the
          same number of elements, else the op runs the scalar kernel
  tile    the chunks one block moves through shared memory per pipeline stage
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

VECTOR_BYTES = 16
# Bias-gradient partial sums (fp32) the vector backward may write before it falls back to the scalar kernel.
MAX_PARTIALS = 1 << 24


def chunk_elems(itemsizes: Sequence[int]) -> int:
    """E: elements per chunk for operands of these element sizes (bytes)."""
    return VECTOR_BYTES // min(itemsizes)


def tile_chunks(e: int, itemsizes: Sequence[int]) -> int:
    """Chunks per tile: 512 (4 per compute thread) unless a stage would pass 24 KiB, then 256."""
    return 512 if e * sum(itemsizes) <= 48 else 256


def common_head(addrs: Sequence[tuple[int, int]], e: int) -> int | None:
    """Smallest head h < E such that every (address, itemsize) is 16-byte aligned at element h, or None."""
    for h in range(e):
        if all((addr + h * size) % VECTOR_BYTES == 0 for addr, size in addrs):
            return h
    return None


def output_offset(base_addr: int, itemsize: int, head: int) -> int:
    """Offset (elements) into a fresh buffer at `base_addr` that makes element `head` 16-byte aligned, so an
    output shares the inputs' head and the op stays on the vector path for misaligned inputs."""
    per = VECTOR_BYTES // itemsize
    for off in range(per):
        if (base_addr + (off + head) * itemsize) % VECTOR_BYTES == 0:
            return off
    raise ValueError(f"itemsize {itemsize} cannot reach {VECTOR_BYTES}-byte alignment from address {base_addr:#x}")


@dataclass(frozen=True, slots=True)
class VectorPlan:
    """How one vector-path launch covers n elements."""

    head: int
    nchunks: int
    tail_start: int  # first element after the body
    ntiles: int
    grid: int


def plan_vector(n: int, head: int | None, e: int, tiles: int, max_grid: int) -> VectorPlan | None:
    """The vector plan, or None when there is no whole chunk to stream (the scalar kernel is then cheaper)."""
    if head is None or n - head < e:
        return None
    nchunks = (n - head) // e
    ntiles = -(-nchunks // tiles)
    return VectorPlan(head, nchunks, head + nchunks * e, ntiles, max(1, min(max_grid, ntiles)))


def backward_grid(ntiles: int, hidden: int, tile_elems: int, max_grid: int,
                  max_partials: int = MAX_PARTIALS) -> int | None:
    """Grid of the vector backward: a multiple of hidden / gcd(hidden, tile_elems), so that grid * tile_elems is a
    multiple of `hidden` and every slot of a block stays in one column (per-thread bias sums, no atomics).
    None when that grid would be too large (then the scalar kernel runs)."""
    m = hidden // math.gcd(hidden, tile_elems)
    grid = max(1, min(max_grid, ntiles) // m) * m
    if grid > 4 * max_grid or grid * tile_elems > max_partials:
        return None
    return grid


def scalar_backward_threads(n: int, hidden: int, target: int) -> int:
    """Threads of the scalar backward: a multiple of `hidden` (so each thread's elements share a column), about
    `target` (or n, if smaller), at least `hidden`."""
    want = max(1, min(n, target))
    return hidden * -(-want // hidden)


def bias_vector_ok(hidden: int, head: int, e: int, bias_addr: int, bias_itemsize: int) -> bool:
    """Whether each chunk's E bias values are one aligned vector load: chunk columns are multiples of E."""
    width = e * bias_itemsize
    return hidden % e == 0 and head % e == 0 and bias_addr % min(VECTOR_BYTES, width) == 0


def simulate_bias_partials(n: int, hidden: int, head: int, e: int, tile_elems: int, grid: int,
                           values: Sequence[float]) -> list[float]:
    """A slow model of the vector backward's bias reduction, for the CPU tests: per-(block, slot) sums as the
    compute threads form them, then the column sums as pl_reduce forms them (head and tail added per column).
    Returns the per-column sums of `values` (length n)."""
    tile_chunks_ = tile_elems // e
    nchunks = (n - head) // e
    ntiles = -(-nchunks // tile_chunks_)
    part = [0.0] * (grid * tile_elems)
    for b in range(grid):
        for t in range(b, ntiles, grid):
            for j in range(tile_elems):
                i = t * tile_elems + j  # body element
                if i < nchunks * e:
                    part[b * tile_elems + j] += values[head + i]
    rows = grid * tile_elems // hidden
    out = [0.0] * hidden
    tail_start = head + nchunks * e
    for k in range(hidden):
        col = (head + k) % hidden
        s = sum(part[r * hidden + k] for r in range(rows))
        s += sum(values[i] for i in range(head) if i % hidden == col)
        s += sum(values[i] for i in range(tail_start, n) if i % hidden == col)
        out[col] = s
    return out
