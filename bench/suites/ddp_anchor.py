"""The optimizer suite's plain data-parallel anchors: what a PyTorch user runs for data parallelism, at pp=1 x dp =
the world size. The whole plain model on every rank, wrapped in torch.nn.parallel.DistributedDataParallel (its
defaults: 25 MiB buckets; gradient_as_bucket_view), its microbatches accumulated under no_sync but the last, whose
backward all-reduces the buckets as they fill; then the optimizer:

  ddp       torch.optim.AdamW (fused on a GPU)
  ddp-zero  torch.distributed.optim.ZeroRedundancyOptimizer over the same AdamW: each rank holds the state of, and
            steps, the whole parameters assigned to it (greedily, by size), then broadcasts them

The models (WORKLOADS): the MLP is bench/suites/plain_mlp.py's blocks holding peerline's initial weights (the same
first losses as peerline's); the GPT is bench/suites/plain_gpt.py's PlainGPT (its own init, so its losses only
agree with peerline's in size), both eager. Same data and loss as peerline: replica r's microbatch m of iteration i
is global microbatch r * M + m, as in peerline's engine (the GPT's tokens from peerline's text feed, the MLP's
counter-based normals); each microbatch's loss is divided by M (peerline's mean over microbatches; DDP averages
over the replicas). Precision: fp32 parameters, under bf16 autocast on bf16 shapes (peerline's --precision
autocast, the recipe its sharded optimizer shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from peerline.bench.suites import plain_gpt
from peerline.bench.suites.gpt_anchor import GPTShape, StageCache, TokenBatches, TorchGPTAnchor
from peerline.bench.suites.torch_pipelining import PipeShape, build_stage_modules, fill


class MLPWorkload:
    """The plain MLP with peerline's initial weights; one replica's M microbatches of inputs and targets."""

    def __init__(self, shape: PipeShape, microbatches: int, replica: int, device: torch.device) -> None:
        self.shape, self.microbatches, self.replica, self.device = shape, microbatches, replica, device
        whole = (microbatches * shape.micro_batch_size, shape.seq, shape.hidden)
        self.inputs, self.targets = torch.empty(whole, device=device), torch.empty(whole, device=device)
        self.generator = torch.Generator(device=device)

    def module(self) -> nn.Module:
        return build_stage_modules(self.shape, 1, [0])[0]

    def load(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.shape.micro_batch_size
        for buf, stream_id in ((self.inputs, 0), (self.targets, 1)):
            for mb in range(self.microbatches):
                fill(buf[mb * b:(mb + 1) * b], self.shape, iteration, self.replica * self.microbatches + mb,
                     stream_id, self.generator)
        return self.inputs, self.targets

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    @staticmethod
    def kernels() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class GPTWorkload:
    """The plain torch GPT (built once per shape by `stages`, copied per row); one replica's M microbatches of
    tokens from peerline's text feed `fill`."""

    def __init__(self, stages: StageCache, fill_tokens: Callable, microbatches: int, replica: int,
                 device: torch.device) -> None:
        self.stages, self.microbatches = stages, microbatches
        shape: GPTShape = replace(stages.shape, microbatches=microbatches)
        first = replica * microbatches

        def fill_replica(inputs: torch.Tensor, labels: torch.Tensor, iteration: int, mb: int) -> None:
            fill_tokens(inputs, labels, iteration, first + mb)

        self.batches = TokenBatches(fill_replica, shape, device, inputs=True, labels=True)

    def module(self) -> nn.Module:
        return self.stages.modules(1, [0])[0]

    def load(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.batches.load(iteration)
        return self.batches.dev["inputs"], self.batches.dev["labels"]

    loss = staticmethod(plain_gpt.cross_entropy_loss)
    #: PEERLINE_ATTENTION restricts SDPA here as in the gpt suite's anchor, so both sides run the same attention
    kernels = staticmethod(TorchGPTAnchor._attention)


class DDPAnchor:
    """One rank of plain data parallelism over the default group: `workload`'s model in DDP, AdamW or
    ZeroRedundancyOptimizer (`zero`), `autocast` bf16 or none. Steps as the module docstring says."""

    def __init__(self, workload: MLPWorkload | GPTWorkload, micro_batch_size: int, lr: float, device: torch.device,
                 autocast: bool, zero: bool) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.workload, self.micro_batch_size, self.device, self.autocast = workload, micro_batch_size, device, autocast
        self.module = workload.module().to(device)
        # The buffers (the GPT's RoPE table, complex64) are computed alike on every rank: DDP leaves them alone
        # instead of broadcasting them before every forward, as a user who knows the model would tell it.
        DDP._set_params_and_buffers_to_ignore_for_model(self.module, [n for n, _ in self.module.named_buffers()])
        # device_ids stays None: the module is already on this rank's device (CPU ranks have none).
        self.ddp = DDP(self.module, bucket_cap_mb=25, gradient_as_bucket_view=True)
        fused = device.type == "cuda" or None
        if zero:
            self.optimizer: Any = ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=torch.optim.AdamW,
                                                          lr=lr, fused=fused)
        else:
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, fused=fused)
        self.losses: list[torch.Tensor] = []
        self.iteration = 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self) -> None:
        """One iteration: the replica's microbatches (gradients reduced in the last one's backward), the step."""
        inputs, targets = self.workload.load(self.iteration)
        self.optimizer.zero_grad(set_to_none=True)
        m, b = self.workload.microbatches, self.micro_batch_size
        self.losses = []
        for mb in range(m):
            rows = slice(mb * b, (mb + 1) * b)
            with contextlib.nullcontext() if mb == m - 1 else self.ddp.no_sync():
                with self._autocast(), self.workload.kernels():
                    loss = self.workload.loss(self.ddp(inputs[rows]), targets[rows])
                (loss / m).backward()
            self.losses.append(loss.detach())
        self.optimizer.step()
        self.iteration += 1

    def read_loss(self) -> float:
        """Mean loss of the last iteration over every replica's microbatches (collective; a host sync)."""
        value = torch.stack([v.float() for v in self.losses]).mean()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        return float(value)

    def optimizer_state_bytes(self) -> int:
        """This rank's optimizer state (ZeroRedundancyOptimizer's: its local AdamW's, over its parameters)."""
        from peerline.distributed.grad_sync.sharded_adamw import optimizer_state_bytes

        return optimizer_state_bytes(getattr(self.optimizer, "optim", self.optimizer))
