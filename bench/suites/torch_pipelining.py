"""The anchor of the pipeline suite: the same model, data and microbatching under torch.distributed.pipelining
(PipelineStage + one of its schedules, bench/suites/torch_schedules.py), with DistributedDataParallel over the
replicas when dp > 1 (schedules of one stage per rank). This is what a user would otherwise run; the suite tries
every schedule and precision recipe and keeps the fastest.

Same model: the default block stack written as a PyTorch user writes it (bench/suites/plain_mlp.py: nn.LayerNorm,
nn.Linear with its bias, F.gelu), holding the weights of peerline's default layers built from the same seeds and
split into the same contiguous stages, so both start from the same weights. Same data:
distributed/model.py `fill_batch` (replica r's microbatch m is global microbatch r*M+m). Same numerics: bf16
autocast on GPU (fp32 on CPU), MSE loss in fp32, AdamW (fused on GPU). torch's schedules divide the summed
microbatch gradients by M (scale_grads), which is peerline's mean over microbatches.

API used (checked on torch 2.11 and 2.13): PipelineStage(submodule, stage_index, num_stages, device, group=),
Schedule*(stage or [stages], n_microbatches, loss_fn=), schedule.step(*args, target=, losses=).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from peerline.bench.suites.torch_schedules import TORCH_SCHEDULES, build_schedule, stage_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PipeShape:
    """One pipeline configuration (what both peerline and the anchor run)."""

    name: str
    layers: int
    hidden: int
    micro_batch_size: int
    seq: int
    microbatches: int
    dtype: str  # "bf16" (autocast) or "fp32"
    seed: int = 0
    lr: float = 1e-3

    @property
    def tokens_per_microbatch(self) -> int:
        return self.micro_batch_size * self.seq

    def sizes(self) -> dict[str, object]:
        return {"layers": self.layers, "hidden": self.hidden, "micro_batch": f"{self.micro_batch_size}x{self.seq}",
                "microbatches": self.microbatches, "dtype": self.dtype}


def _run_config(shape: PipeShape, **overrides):
    from peerline.distributed.config import RunConfig

    return RunConfig(layers=shape.layers, hidden=shape.hidden, micro_batch_size=shape.micro_batch_size,
                     seq=shape.seq, microbatches=shape.microbatches, seed=shape.seed, lr=shape.lr,
                     dtype=shape.dtype, **overrides)


def build_stage_module(shape: PipeShape, n_stages: int, stage: int) -> nn.Sequential:
    """The plain layers of `stage` (see build_stage_modules)."""
    return build_stage_modules(shape, n_stages, [stage])[0]


def build_stage_modules(shape: PipeShape, n_stages: int, stages: list[int]) -> list[nn.Sequential]:
    """The layers of each of `stages` (of `n_stages`) as plain PyTorch modules (plain_mlp.PlainMLPBlock) with the
    weights peerline's default model has there."""
    from peerline.bench.suites.plain_mlp import from_default_layers
    from peerline.distributed.model import build_stages

    modules, _ = build_stages(_run_config(shape), n_stages, list(stages), "torch")
    return [from_default_layers(m) for m in modules]


def fill(out: torch.Tensor, shape: PipeShape, iteration: int, global_mb: int, stream: int,
         generator: torch.Generator) -> None:
    from peerline.distributed.model import fill_batch

    fill_batch(out, shape.seed, iteration, global_mb, stream, generator)


class TorchPipelineAnchor:
    """One rank of a pp x dp torch.distributed.pipelining run (rank = replica * pp + pipeline rank, as peerline's
    mesh); `schedule` is a torch schedule (torch_schedules.TORCH_SCHEDULES), placing one or two stages per rank."""

    def __init__(self, shape: PipeShape, schedule: str, pp: int, dp: int, rank: int, device: torch.device,
                 pp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
                 param_dtype: torch.dtype | None = None) -> None:
        """param_dtype: parameters (and inputs) in this dtype, no autocast (the bf16-parameters recipe); None: fp32
        parameters under the shape's autocast."""
        from torch.distributed.pipelining import PipelineStage

        if schedule not in TORCH_SCHEDULES:
            raise ValueError(f"unknown torch schedule {schedule!r}; choose from {', '.join(TORCH_SCHEDULES)}")
        self.shape, self.schedule_name, self.pp, self.dp, self.device = shape, schedule, pp, dp, device
        self.stage_index, self.replica = rank % pp, rank // pp  # the pipeline rank (its first stage, if several)
        ids = stage_ids(schedule, self.stage_index, pp)
        n_stages = pp * len(ids)
        if len(ids) > 1 and dp > 1:
            raise ValueError(f"torch {schedule} with dp > 1: DDP over several stages per rank is not set up here")
        self.is_first, self.is_last = 0 in ids, n_stages - 1 in ids
        self.modules = [m.to(device, dtype=param_dtype) for m in build_stage_modules(shape, n_stages, ids)]
        self.module = self.modules[0]
        self.autocast_dtype = torch.bfloat16 if shape.dtype == "bf16" and param_dtype is None else None
        submod: nn.Module = self.module
        if dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # DDP's defaults (25 MiB buckets) with gradient_as_bucket_view, as the measured anchor. torch's stage
            # runs every forward and every backward but the last under no_sync and arms the reducer by hand for
            # the last backward, so the all-reduce overlaps the last microbatch's backward only.
            # device_ids stays None: the module already lives on this rank's device, and with device_ids DDP would
            # move its inputs there, meta tensors of torch's shape inference included (which cannot be copied).
            submod = DDP(self.module, process_group=dp_group, bucket_cap_mb=25, gradient_as_bucket_view=True)
        self.submod = submod
        pipe = [PipelineStage(m, sid, n_stages, device, group=pp_group)
                for m, sid in zip([submod, *self.modules[1:]], ids, strict=True)]
        self.schedule = build_schedule(schedule, pipe, shape.microbatches, self._loss)
        on_gpu = device.type == "cuda"
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=shape.lr, fused=on_gpu or None)
        self.generator = torch.Generator(device=device)
        whole = (shape.microbatches * shape.micro_batch_size, shape.seq, shape.hidden)
        self.inputs = torch.empty(whole, device=device, dtype=param_dtype) if self.is_first else None
        self.targets = torch.empty(whole, device=device) if self.is_last else None
        self.losses: list[torch.Tensor] = []
        self.iteration = 0

    @staticmethod
    def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's no_sync around the whole step. torch's stage already runs each microbatch's forward under no_sync;
        the one forward it does not is its first-step shape inference on meta tensors, which would otherwise arm
        DDP's reducer for a backward that never comes, and the bucket rebuild of the next iteration then fails an
        internal assert (torch 2.13: 'rebuilt parameter indices size is not same as original model parameters
        size'). The last backward still reduces: the stage calls the reducer's prepare_for_backward itself."""
        no_sync = getattr(self.submod, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _load(self) -> None:
        m, b = self.shape.microbatches, self.shape.micro_batch_size
        for buf, stream_id in ((self.inputs, 0), (self.targets, 1)):
            if buf is None:
                continue
            for mb in range(m):
                fill(buf[mb * b:(mb + 1) * b], self.shape, self.iteration, self.replica * m + mb, stream_id,
                     self.generator)

    def step(self) -> None:
        """One training iteration: data, all microbatches through the schedule, gradient sync, AdamW."""
        self._load()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses = []
        with self._autocast(), self._no_sync():
            if self.is_first and self.is_last:
                self.schedule.step(self.inputs, target=self.targets, losses=self.losses)
            elif self.is_first:
                self.schedule.step(self.inputs)
            elif self.is_last:
                self.schedule.step(target=self.targets, losses=self.losses)
            else:
                self.schedule.step()
        self.optimizer.step()
        self.iteration += 1

    def local_loss(self) -> torch.Tensor:
        """Mean loss of the last iteration over this replica's microbatches (zero off the last stage)."""
        if not self.losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in self.losses]).mean()

    def read_loss(self) -> float:
        """Mean loss over all microbatches and replicas (collective over the world; a host sync)."""
        value = self.local_loss().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
        return float(value) / self.dp


def measure_stage_ms(module: nn.Module, shape: PipeShape, device: torch.device, is_first: bool, is_last: bool,
                     warmup: int = 3, reps: int = 10, stream: torch.cuda.Stream | None = None
                     ) -> tuple[float, float]:
    """Forward and backward time of one microbatch through this stage alone (no communication), for the ideal
    time. Inputs of a later stage require grad, so the backward computes the gradient it would send back. The
    input is what the stage gets in its pipeline: in the parameters' dtype where they are bf16 / fp16 (no
    autocast; the first stage's own cast of fp32 data left out), else fp32 under bf16 autocast for a bf16 shape.
    `stream`: where to run (a peerline stage's compute stream; None: the current stream, as torch runs)."""
    from peerline.bench.benchkit import time_fn
    from peerline.distributed.streams import use

    b, s, h = shape.micro_batch_size, shape.seq, shape.hidden
    param = next(module.parameters(), None)
    low = param is not None and param.dtype in (torch.bfloat16, torch.float16)
    cast = (torch.autocast(device.type, dtype=torch.bfloat16) if shape.dtype == "bf16" and not low
            else contextlib.nullcontext())
    with use(stream):  # inputs made on the stream that reads them
        x = torch.randn(b, s, h, device=device, dtype=param.dtype if low else torch.float32,
                        requires_grad=not is_first)
        target = torch.randn(b, s, h, device=device)
        grad_out = torch.randn(b, s, h, device=device, dtype=x.dtype)

    def forward() -> torch.Tensor:
        with cast:
            out = module(x)
        return F.mse_loss(out.float(), target) if is_last else out

    def forward_backward() -> None:
        out = forward()
        if is_last:
            out.backward()
        else:
            out.backward(grad_out.to(out.dtype))

    with use(stream):
        fwd = time_fn(forward, warmup=warmup, reps=reps, device=device, stream=stream)
        both = time_fn(forward_backward, warmup=warmup, reps=reps, device=device, stream=stream)
    module.zero_grad(set_to_none=True)
    return fwd.median_ms, max(both.median_ms - fwd.median_ms, 0.0)
