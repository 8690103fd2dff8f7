"""The anchor of the gpt suite: the GPT, data and loss under torch.distributed.pipelining, for one schedule, one
precision recipe and its blocks eager or compiled. This is what a user would otherwise run.

Two models (MODELS), each cut by the same stage split (gpt_split: models/flops.py's per-layer FLOPs balanced by
distributed/model.py's split_by_weight, the embedding and the head counted as layers; the schedules of two stages
per rank split the same layers into twice the stages):
  plain     the anchor: a GPT written with plain torch modules (bench/suites/plain_gpt.py: nn.Linear, nn.LayerNorm,
            SDPA, torchtitan's RoPE), the architecture, parameters and FLOPs of --model gpt, its own init; its
            blocks eager or each under torch.compile, as torchtitan runs them
  peerline  peerline's own GPT under torch (distributed/assemble.py make_model: models/gpt.py build_gpt_layers with
            torch kernels): peerline's layers and weights, eager; a second, labelled row
Same data: peerline's text feed (distributed/data/token_feed.py token_data: the same token file, sampler and seed;
microbatch m of iteration i is global microbatch m), staged through pinned host memory. Same loss: cross-entropy on
fp32 logits, mean over the microbatch's tokens (plain_gpt.py's, and peerline's distributed/model.py's); torch's
schedules divide the summed microbatch gradients by M, which is peerline's mean over microbatches. AdamW (fused on
GPU).

One device, no pipelining library (the gpt suite's --gpt-single): PlainGPTOneDevice trains the whole plain model
eager, bf16 parameters and fused AdamW by default, per microbatch forward and backward, then one step.

The schedules, their stage placement, the precision recipes, the blocks and the search for the fastest are shared
with the pipeline suite (bench/suites/torch_schedules.py).

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

from peerline.bench.suites import plain_gpt
from peerline.bench.suites.torch_schedules import build_schedule, param_dtype, stage_ids
from peerline.distributed.model import cross_entropy_loss, split_by_weight
from peerline.models.flops import gpt_layer_costs

#: the anchor's model -> its label in records and notes
MODELS = {"plain": "plain torch GPT", "peerline": "peerline's GPT under torch"}


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


def gpt_split(shape: GPTShape, vocab: int, n_stages: int) -> list[tuple[int, int]]:
    """The [start, stop) layers of each stage: peerline's split of --model gpt (distributed/assemble.py make_model),
    the layers + 2 (embedding, blocks, head) balanced by their forward FLOPs."""
    costs = gpt_layer_costs(vocab=vocab, hidden=shape.hidden, layers=shape.layers, seq=shape.seq)
    return split_by_weight(costs, n_stages)


class StageCache:
    """The CPU stage modules of each split of one model (MODELS), built once per shape and copied for every anchor
    candidate: plain_gpt.PlainGPT's layer ranges of gpt_split, or peerline's own model assembly (the GPT split by
    compute; torch kernels)."""

    def __init__(self, shape: GPTShape, vocab: int, model: str = "plain") -> None:
        if model not in MODELS:
            raise ValueError(f"unknown anchor model {model!r}; choose from {', '.join(MODELS)}")
        self.shape, self.vocab, self.model = shape, vocab, model
        self.cfg = shape.run_config(None, device="cpu")
        self.loss = plain_gpt.cross_entropy_loss if model == "plain" else cross_entropy_loss
        self._built: dict[tuple[int, tuple[int, ...]], list[nn.Module]] = {}

    def modules(self, n_stages: int, stage_ids: list[int]) -> list[nn.Module]:
        key = (n_stages, tuple(stage_ids))
        if key not in self._built:
            self._built[key] = self._build(n_stages, list(stage_ids))
        return [copy.deepcopy(m) for m in self._built[key]]

    def _build(self, n_stages: int, stage_ids: list[int]) -> list[nn.Module]:
        if self.model == "peerline":
            from peerline.distributed.assemble import make_model

            grid = SimpleNamespace(n_stages=n_stages, stage_ids=stage_ids)  # what make_model reads of a Grid
            return make_model(self.cfg, grid, "torch").modules
        s, bounds = self.shape, gpt_split(self.shape, self.vocab, n_stages)
        return [plain_gpt.PlainGPT(vocab=self.vocab, hidden=s.hidden, heads=s.heads, layers=s.layers, seq=s.seq,
                                   start=bounds[sid][0], stop=bounds[sid][1], seed=s.seed) for sid in stage_ids]


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


def sdpa_backend() -> contextlib.AbstractContextManager:
    """PEERLINE_ATTENTION=flash or cudnn restricts the anchor's SDPA to that backend too, so both sides of a
    measurement run the same attention kernels; by default (auto) SDPA picks its own, as peerline's does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from peerline.kernels.rope import BACKENDS, attention_backend

    name = attention_backend()
    if name == "auto":
        return contextlib.nullcontext()
    return sdpa_kernel([BACKENDS[name] or SDPBackend.FLASH_ATTENTION])


class TorchGPTAnchor:
    """One rank of a pp-stage torch.distributed.pipelining run of the GPT (no data parallelism). `blocks`
    "compiled" wraps every block of the plain model in torch.compile (plain_gpt.compile_blocks, `compile_backend`)
    after a reset of dynamo's caches, so each candidate compiles afresh."""

    def __init__(self, stages: StageCache, fill: Callable, schedule: str, recipe: str, pp: int, rank: int,
                 device: torch.device, blocks: str = "eager", compile_backend: str = "inductor") -> None:
        from torch.distributed import pipelining

        if blocks == "compiled" and stages.model != "plain":
            raise ValueError(f"compiled blocks are the plain model's; {MODELS[stages.model]} runs eager")
        shape = stages.shape
        ids = stage_ids(schedule, rank, pp)
        n_stages = pp * len(ids)
        self.modules = [m.to(device=device, dtype=param_dtype(recipe)) for m in stages.modules(n_stages, ids)]
        if blocks == "compiled":
            torch._dynamo.reset()
            self.modules = [plain_gpt.compile_blocks(m, compile_backend) for m in self.modules]
        self.device, self.recipe, self.iteration = device, recipe, 0
        self.is_first, self.is_last = 0 in ids, n_stages - 1 in ids
        pipe = [pipelining.PipelineStage(m, sid, n_stages, device) for m, sid in zip(self.modules, ids, strict=True)]
        self.schedule = build_schedule(schedule, pipe, shape.microbatches, stages.loss)
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=shape.lr, fused=device.type == "cuda" or None)
        self.batches = TokenBatches(fill, shape, device, self.is_first, self.is_last)
        self.losses: list[torch.Tensor] = []

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.recipe != "autocast":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    _attention = staticmethod(sdpa_backend)

    def step(self) -> None:
        """One training iteration: data, all microbatches through the schedule, AdamW."""
        self.batches.load(self.iteration)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses = []
        inputs, labels = self.batches.dev.get("inputs"), self.batches.dev.get("labels")
        with self._autocast(), self._attention():
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


class PlainGPTOneDevice:
    """The whole plain torch GPT (plain_gpt.PlainGPT, no pipelining library) eager on one device, the anchor's bf16
    recipe by default: parameters in `dtype`, no autocast, AdamW (fused on GPU). Per microbatch forward,
    cross-entropy / M and backward, then one optimizer step; the tokens of peerline's text feed (TokenBatches)."""

    def __init__(self, shape: GPTShape, vocab: int, fill: Callable, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = plain_gpt.PlainGPT(vocab=vocab, hidden=shape.hidden, heads=shape.heads, layers=shape.layers,
                                        seq=shape.seq, seed=shape.seed).to(device=device, dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=shape.lr, fused=device.type == "cuda" or None)
        self.batches = TokenBatches(fill, shape, device, True, True)
        self.shape, self.device, self.iteration = shape, device, 0
        self.loss = torch.zeros((), device=device)

    def step(self) -> None:
        """One training iteration: data, every microbatch's forward and backward, AdamW."""
        self.batches.load(self.iteration)
        self.optimizer.zero_grad(set_to_none=True)
        b, m = self.shape.micro_batch_size, self.shape.microbatches
        total = torch.zeros((), device=self.device)
        with sdpa_backend():
            for x, y in zip(self.batches.dev["inputs"].split(b), self.batches.dev["labels"].split(b), strict=True):
                loss = plain_gpt.cross_entropy_loss(self.model(x), y) / m
                loss.backward()
                total += loss.detach()
        self.loss = total
        self.optimizer.step()
        self.iteration += 1

    def read_loss(self) -> float:
        """Mean loss of the last iteration over its microbatches (a host sync)."""
        return float(self.loss)


def token_source(shape: GPTShape) -> tuple[int, Callable[[torch.Tensor, torch.Tensor, int, int], None]]:
    """(vocabulary, fill) of the default corpus for this shape: peerline's own text feed resolution, so the anchor
    reads the tokens peerline's run reads."""
    from peerline.distributed.data.token_feed import token_data

    data = token_data(shape.run_config(None, device="cpu"))
    return data.vocab, data.fill
