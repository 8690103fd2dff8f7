"""The anchor of the gpt suite: the same GPT, data and loss under torch.distributed.pipelining, for one schedule and
one precision recipe. This is what a user would otherwise run.

Same model: peerline's own model assembly (distributed/assemble.py make_model: models/gpt.py build_gpt_layers
split by compute, here with torch kernels), so the anchor's layers, weights and stage split are peerline's;
the schedules of two stages per rank split the same layers into twice the stages. Same data:
peerline's text feed (distributed/data/token_feed.py token_data: the same token file, sampler and seed; microbatch
m of iteration i is global microbatch m), staged through pinned host memory. Same loss: peerline's
cross_entropy_loss (distributed/model.py: fp32 logits, mean over the microbatch's tokens); torch's schedules
divide the summed microbatch gradients by M, which is peerline's mean over microbatches. AdamW (fused on GPU).

The schedules, their stage placement, the precision recipes and the search for the fastest are shared with the
pipeline suite (bench/suites/torch_schedules.py); the embedding and the head count as layers of the split.

API used (written against torch 2.13; the same in 2.11, the GPU machines' torch): PipelineStage(submodule,
stage_index, num_stages, device), Schedule*(stage or [stages], n_microbatches, loss_fn=),
schedule.step(*args, target=, losses=).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from peerline.bench.suites.torch_schedules import build_schedule, param_dtype, stage_ids
from peerline.distributed.model import cross_entropy_loss


@dataclass(frozen=True, slots=True)
class GPTShape:
    """One GPT configuration (what both peerline and the anchor run); vocab comes from the token data."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch_size: int
    microbatches: int
    dtype: str  # "bf16" (peerline: autocast) or "fp32"
    seed: int = 0
    lr: float = 1e-3

    def sizes(self) -> dict[str, object]:
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "seq": self.seq,
                "micro_batch": f"{self.micro_batch_size}x{self.seq}", "microbatches": self.microbatches,
                "dtype": self.dtype}

    def run_config(self, vocab: int | None, **overrides: Any):
        """peerline's RunConfig of this shape: --model gpt on the default text corpus, cross-entropy; vocab None:
        the data's."""
        from peerline.distributed.config import RunConfig

        return RunConfig(model="gpt", data="text", loss="cross-entropy", vocab=vocab, heads=self.heads,
                         layers=self.layers, hidden=self.hidden, seq=self.seq,
                         micro_batch_size=self.micro_batch_size, microbatches=self.microbatches, seed=self.seed,
                         lr=self.lr, dtype=self.dtype, **overrides)


class StageCache:
    """The CPU stage modules of each split, built once per shape by peerline's own model assembly (the GPT split by
    compute; torch kernels) and copied for every anchor candidate."""

    def __init__(self, shape: GPTShape) -> None:
        self.shape, self.cfg = shape, shape.run_config(None, device="cpu")
        self._built: dict[tuple[int, tuple[int, ...]], list[nn.Module]] = {}

    def modules(self, n_stages: int, stage_ids: list[int]) -> list[nn.Module]:
        from peerline.distributed.assemble import make_model

        key = (n_stages, tuple(stage_ids))
        if key not in self._built:
            grid = SimpleNamespace(n_stages=n_stages, stage_ids=list(stage_ids))  # what make_model reads of a Grid
            self._built[key] = make_model(self.cfg, grid, "torch").modules
        return [copy.deepcopy(m) for m in self._built[key]]


class TokenBatches:
    """One iteration's inputs and labels [M * B, T] on the device, filled through pinned memory by `fill` (the
    text feed's fill(inputs, labels, iteration, global_mb)).
    The host waits for the previous iteration's copy before it overwrites the pinned buffers."""

    def __init__(self, fill: Callable, shape: GPTShape, device: torch.device, inputs: bool, labels: bool) -> None:
        self.fill, self.shape, self.device = fill, shape, device
        whole = (shape.microbatches * shape.micro_batch_size, shape.seq)
        pin = device.type == "cuda"
        self.host = {k: torch.empty(whole, dtype=torch.int64, pin_memory=pin) for k, on in
                     (("inputs", inputs), ("labels", labels)) if on}
        self.dev = {k: torch.empty(whole, dtype=torch.int64, device=device) for k in self.host}
        self.copied = torch.cuda.Event() if pin else None

    def load(self, iteration: int) -> None:
        if not self.host:
            return
        if self.copied is not None:
            self.copied.synchronize()
        b = self.shape.micro_batch_size
        scratch = {k: torch.empty(b, self.shape.seq, dtype=torch.int64) for k in ("inputs", "labels")}
        for mb in range(self.shape.microbatches):
            rows = slice(mb * b, (mb + 1) * b)
            self.fill(scratch["inputs"], scratch["labels"], iteration, mb)
            for k, buf in self.host.items():
                buf[rows].copy_(scratch[k])
        for k, buf in self.host.items():
            self.dev[k].copy_(buf, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class TorchGPTAnchor:
    """One rank of a pp-stage torch.distributed.pipelining run of the GPT (no data parallelism)."""

    def __init__(self, stages: StageCache, fill: Callable, schedule: str, recipe: str, pp: int, rank: int,
                 device: torch.device) -> None:
        from torch.distributed import pipelining

        shape = stages.shape
        ids = stage_ids(schedule, rank, pp)
        n_stages = pp * len(ids)
        self.modules = [m.to(device=device, dtype=param_dtype(recipe)) for m in stages.modules(n_stages, ids)]
        self.device, self.recipe, self.iteration = device, recipe, 0
        self.is_first, self.is_last = 0 in ids, n_stages - 1 in ids
        pipe = [pipelining.PipelineStage(m, sid, n_stages, device) for m, sid in zip(self.modules, ids, strict=True)]
        self.schedule = build_schedule(schedule, pipe, shape.microbatches, cross_entropy_loss)
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=shape.lr, fused=device.type == "cuda" or None)
        self.batches = TokenBatches(fill, shape, device, self.is_first, self.is_last)
        self.losses: list[torch.Tensor] = []

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.recipe != "autocast":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def step(self) -> None:
        """One training iteration: data, all microbatches through the schedule, AdamW."""
        self.batches.load(self.iteration)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses = []
        inputs, labels = self.batches.dev.get("inputs"), self.batches.dev.get("labels")
        with self._autocast():
            if self.is_first and self.is_last:
                self.schedule.step(inputs, target=labels, losses=self.losses)
            elif self.is_first:
                self.schedule.step(inputs)
            elif self.is_last:
                self.schedule.step(target=labels, losses=self.losses)
            else:
                self.schedule.step()
        self.optimizer.step()
        self.iteration += 1

    def read_loss(self) -> float:
        """Mean loss of the last iteration over its microbatches (collective over the world; a host sync)."""
        value = (torch.stack([v.detach().float() for v in self.losses]).mean() if self.losses
                 else torch.zeros((), device=self.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
        return float(value)


def token_source(shape: GPTShape) -> tuple[int, Callable[[torch.Tensor, torch.Tensor, int, int], None]]:
    """(vocabulary, fill) of the default corpus for this shape: peerline's own text feed resolution, so the anchor
    reads the tokens peerline's run reads."""
    from peerline.distributed.data.token_feed import token_data

    data = token_data(shape.run_config(None, device="cpu"))
    return data.vocab, data.fill
