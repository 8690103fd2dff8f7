"""The allreduce suite's workload: peerline's model, fixed data, and one training step under GradBuckets or DDP.

Shared by the sweep (allreduce.py) and the head-to-head rounds (allreduce_h2h.py). The model is the product's
default block stack (LayerNorm -> Linear h->4h, no bias -> + bias, GELU -> Linear 4h->h -> residual, from
peerline.distributed.model with torch kernels), so peerline's buckets and DDP's see the parameters the engine
trains; inputs and targets are random tensors made once, MSE loss, AdamW.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from peerline.bench.benchkit import Timing, time_fn
from peerline.distributed.config import RunConfig
from peerline.distributed.grad_sync.buckets import GradBuckets
from peerline.distributed.model import build_default_layers
from peerline.distributed.streams import create_rank_streams, use

log = logging.getLogger(__name__)
MODEL_SEED = 1234  # every variant's model starts from the same weights


@dataclass(frozen=True, slots=True)
class Shape:
    """The model (blocks of width `hidden`), its microbatches and the gradient buckets."""

    hidden: int = 2048
    blocks: int = 8
    micro_batch: int = 8
    seq: int = 1024
    microbatches: int = 1
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    """peerline's default block stack (peerline.distributed.model, torch kernels) of `shape.blocks` blocks, in
    `dtype`: the model the engine trains, for peerline and DDP alike. Built on the device; the same weights on
    every rank (rank 0's, broadcast) and for every variant."""
    cfg = RunConfig(hidden=shape.hidden, layers=shape.blocks, seed=MODEL_SEED)
    with torch.device(device):
        model = nn.Sequential(*build_default_layers(cfg, 0, shape.blocks, "torch")).to(dtype=dtype)
    for p in model.parameters():
        dist.broadcast(p.detach(), src=0)
    return model


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, fused and capturable on CUDA (the graph variant captures its step)."""
    if device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


class Workload:
    """Static inputs / targets of every microbatch and the compute stream every variant runs on."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        self.streams = create_rank_streams(device)
        g = torch.Generator(device=device).manual_seed(99 + dist.get_rank())
        dims = (shape.micro_batch, shape.seq, shape.hidden)
        with use(self.streams.compute):
            self.xs = [torch.randn(dims, device=device, generator=g) for _ in range(shape.microbatches)]
            self.ys = [torch.randn(dims, device=device, generator=g) for _ in range(shape.microbatches)]
        self.autocast_dtype = torch.bfloat16 if device.type == "cuda" else None

    def loss(self, model: nn.Module, m: int) -> torch.Tensor:
        if self.autocast_dtype is None:
            out = model(self.xs[m])
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                out = model(self.xs[m].to(next(model.parameters()).dtype))
        return F.mse_loss(out.float(), self.ys[m]) / self.shape.microbatches

    def time(self, fn: Callable[[], Any], warmup: int, reps: int) -> Timing:
        with use(self.streams.compute):
            return time_fn(fn, warmup=warmup, reps=reps, stream=self.streams.compute, device=self.device)


def step_peerline(w: Workload, model: nn.Module, gb: GradBuckets, opt: torch.optim.Optimizer,
                  sync: bool = True) -> None:
    """One training step; with sync=False the hooks stay unarmed: the local (no all-reduce) step."""
    gb.zero_grad()
    for m in range(w.shape.microbatches):
        if sync and m == w.shape.microbatches - 1:
            gb.arm()
        w.loss(model, m).backward()
    if sync:
        gb.finish()
    opt.step()


def step_ddp(w: Workload, ddp: DistributedDataParallel, opt: torch.optim.Optimizer) -> None:
    """One DDP step: microbatches but the last under no_sync, the last one's backward all-reduces."""
    opt.zero_grad(set_to_none=False)  # the grads are views into DDP's buckets: keep them
    for m in range(w.shape.microbatches):
        if m < w.shape.microbatches - 1:
            with ddp.no_sync():
                w.loss(ddp, m).backward()
        else:
            w.loss(ddp, m).backward()
    opt.step()


def capture_step(w: Workload, model: nn.Module, gb: GradBuckets, opt: torch.optim.Optimizer
                 ) -> torch.cuda.CUDAGraph | str:
    """peerline's whole step captured into one CUDA graph on the compute stream, or the reason it failed (a failed
    capture is a result, not a crash of the suite)."""
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=w.streams.compute, capture_error_mode="thread_local"):
            step_peerline(w, model, gb, opt)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("graph capture failed: %s: %s", type(exc).__name__, exc)
        torch.cuda.synchronize()
        dist.barrier()
        return f"{type(exc).__name__}: {exc}"
    return g


def free_memory(dev: torch.device) -> None:
    """Give back what the variant measured last left behind, so the next one starts from the same memory."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
