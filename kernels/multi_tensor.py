"""The tables a multi-tensor optimizer kernel reads (compact_adamw.cu, fused_adamw.cu): one block per chunk of
CHUNK elements of one tensor, THREADS threads a block.

  table  [L + S + 2, T] int64: the L lists' pointers (one row each), the S scalar lists' pointers (a scalar per
         tensor, such as its step count), every tensor's numel, and 1 where the kernel's 4-element vector path may
         run (every list's pointer aligned to 4 of its elements), else 0
  chunks [2, C] int64: each block's tensor index and first element

Built once on the host; `MultiTensorLaunch` copies them to the device, so a launch passes pointers only and can be
captured into a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

THREADS = 256
CHUNK = 32768  # elements per block: 32 vectors of 4 per thread


def vector_aligned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether 4 elements of every tensor load as one vector (each pointer a multiple of 4 elements' bytes)."""
    return all(t.data_ptr() % (4 * t.element_size()) == 0 for t in tensors)


def build_tables(lists: Sequence[Sequence[torch.Tensor]], scalars: Sequence[Sequence[torch.Tensor]] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, chunks) of same-length lists of same-shaped tensors and of lists of one scalar per tensor (see the
    module doc), as host int64 tensors."""
    rows = [[t.data_ptr() for t in ts] for ts in (*lists, *scalars)]
    rows.append([t.numel() for t in lists[0]])
    rows.append([int(vector_aligned(ts)) for ts in zip(*lists, strict=True)])
    owners, starts = [], []
    for i, t in enumerate(lists[0]):
        for start in range(0, t.numel(), CHUNK):
            owners.append(i)
            starts.append(start)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor([owners, starts], dtype=torch.int64).view(2, -1)


def check_lists(lists: Sequence[Sequence[torch.Tensor]], dtypes: Sequence[torch.dtype], names: Sequence[str],
                device: torch.device, what: str) -> None:
    """Non-empty lists of one length; each tensor contiguous, on `device`, of its list's dtype and the first
    list's shape. ValueError naming `what` (the optimizer) and the list otherwise."""
    if not lists[0] or len({len(ts) for ts in lists}) != 1:
        raise ValueError(f"{what}: {', '.join(names)} must be non-empty lists of one length")
    for ts, dtype, name in zip(lists, dtypes, names, strict=True):
        for t, p in zip(ts, lists[0], strict=True):
            if t.dtype != dtype or t.device != device or t.shape != p.shape or not t.is_contiguous():
                raise ValueError(f"{what}: a {name} is {t.dtype} {tuple(t.shape)} on {t.device}"
                                 f"{'' if t.is_contiguous() else ' (not contiguous)'}; expected a contiguous "
                                 f"{dtype} {tuple(p.shape)} on {device}")


class MultiTensorLaunch:
    """One group's device tables for the `extern "C"` kernel `kernel` of the CUDA file `source`, and the tensors
    they point into (kept alive as long as the tables). A subclass names its kernel and builds the tables."""

    source: Path
    kernel = ""

    def __init__(self, table: torch.Tensor, chunks: torch.Tensor, device: torch.device,
                 keep: Sequence[Sequence[torch.Tensor]]) -> None:
        self.device = device
        self.tensors = table.shape[1]
        self.n_chunks = chunks.shape[1]
        self.table = table.to(device)
        self.chunks = chunks.to(device)
        self.keep = [list(ts) for ts in keep]

    def _launch(self, kinds: str, values: tuple) -> None:
        """Launch the kernel on torch's current stream over the tables (its first five parameters: table, tensors,
        chunks, chunk count, CHUNK), then `values` typed by `kinds` (launch.ArgPack's letters)."""
        from peerline.kernels.compile import load_kernel
        from peerline.kernels.elementwise import launch_raw

        if self.n_chunks == 0:
            return
        kernel, _ = load_kernel(self.source, self.kernel, self.device.index)
        launch_raw(kernel, self.n_chunks, THREADS, "pipiq" + kinds,
                   (self.table.data_ptr(), self.tensors, self.chunks.data_ptr(), self.n_chunks, CHUNK, *values),
                   self.device)
