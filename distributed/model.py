"""The model: the default residual-MLP block stack, user models, their split into stages, and synthetic data.

Every layer of the default model is initialised from its own seed (seed, layer index), so a stage builds exactly
the weights the single-process reference builds for the same layers, whatever the split.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.kernels import ops
from peerline.kernels.fused_linear import FusedLinear

log = logging.getLogger(__name__)


class ResidualMLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)) + b1)). fc1 has no bias of its own: its bias is fused into the GELU kernel.

    fc1/fc2 are nn.Linear subclasses (same parameters, init and state_dict); with kernels="peerline" their weight
    gradients are accumulated straight into the fp32 .grad (kernels/fused_linear.py)."""

    def __init__(self, hidden: int, kernels: str = "torch") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = FusedLinear(hidden, 4 * hidden, bias=False, impl=kernels)
        self.fc1_bias = nn.Parameter(torch.empty(4 * hidden).uniform_(-hidden ** -0.5, hidden ** -0.5))
        self.fc2 = FusedLinear(4 * hidden, hidden, impl=kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ops.bias_gelu(self.fc1(self.norm(x)), self.fc1_bias, self.kernels)
        return ops.residual_add(x, self.fc2(h), self.kernels)


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer `index`: every layer has its own, so any split of the model builds the same weights."""
    return seed * 1_000_003 + index


def build_default_layers(cfg: RunConfig, start: int, stop: int, kernels: str) -> list[nn.Module]:
    """Layers [start, stop) of the default model, each seeded by its index (on the CPU, so weights do not depend
    on the device)."""
    layers = []
    for i in range(start, stop):
        torch.manual_seed(layer_seed(cfg.seed, i))
        layers.append(ResidualMLPBlock(cfg.hidden, kernels))
    return layers


def load_user_model(spec: str, seed: int) -> nn.Sequential:
    """Import 'pkg.module:factory', call it under the run's seed, and check it returns an nn.Sequential."""
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[], object] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load model factory {spec!r}: {exc}") from None
    torch.manual_seed(seed)
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported as one line
        raise ConfigError(f"model factory {spec!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Sequential")
    return model


def split_even(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of near-equal length (earlier stages take the remainder)."""
    if n_layers < n_stages:
        raise ConfigError(f"cannot split {n_layers} layers into {n_stages} stages: every stage needs a layer")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_by_weight(weights: list[int], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous split that minimises the heaviest stage (weights: parameters per layer). Exact dynamic
    programme: models have few layers, and a greedy split can leave a stage empty."""
    n = len(weights)
    if n < n_stages:
        raise ConfigError(f"cannot split {n} layers into {n_stages} stages: every stage needs a layer")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + max(w, 1))  # a parameter-free layer still costs something
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def build_stages(cfg: RunConfig, n_stages: int, stage_ids: list[int], kernels: str
                 ) -> tuple[list[nn.Sequential], list[tuple[int, int]]]:
    """The stage modules this rank runs (stage_ids of n_stages) and the split of the whole model."""
    if cfg.model is None:
        bounds = split_even(cfg.layers, n_stages)
        stages = [nn.Sequential(*build_default_layers(cfg, *bounds[s], kernels)) for s in stage_ids]
        return stages, bounds
    full = load_user_model(cfg.model, cfg.seed)
    bounds = split_by_weight([sum(p.numel() for p in layer.parameters()) for layer in full], n_stages)
    return [nn.Sequential(*list(full)[slice(*bounds[s])]) for s in stage_ids], bounds


def describe_split(bounds: list[tuple[int, int]], n_params: list[int] | None = None) -> str:
    """One line naming each stage's layers (and its parameters, when given), for the start-up log."""
    parts = []
    for s, (a, b) in enumerate(bounds):
        extra = f" ({n_params[s] / 1e6:.2f} M params)" if n_params else ""
        parts.append(f"stage {s}: layers {a}-{b - 1}{extra}")
    return "; ".join(parts)


def data_seed(seed: int, iteration: int, global_mb: int, stream: int) -> int:
    """The generator seed of one synthetic buffer. Python hashes tuples of ints deterministically (no
    per-process salt), so every rank derives the same seed."""
    return hash((seed, iteration, global_mb, stream)) & 0x7FFF_FFFF_FFFF_FFFF


def fill_batch(out: torch.Tensor, seed: int, iteration: int, global_mb: int, stream: int,
               generator: torch.Generator) -> torch.Tensor:
    """Fill `out` in place with the deterministic synthetic data of (iteration, microbatch); stream 0 = inputs,
    1 = targets. In place, so CUDA-graph static buffers keep their addresses."""
    generator.manual_seed(data_seed(seed, iteration, global_mb, stream))
    return out.normal_(generator=generator)
