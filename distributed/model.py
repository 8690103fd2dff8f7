"""The model: the default residual-MLP block stack, user models, their split into stages, the losses, and synthetic
data.

Every layer of the default model is initialised from its own seed (seed, layer index), so a stage builds exactly
the weights the single-process reference builds for the same layers, whatever the split. A user factory's layer
builders get the same treatment; a factory that returns a whole nn.Sequential is called under the run's seed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.choices import LOSSES
from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.env import RankConfigError, launch_rank_world
from peerline.kernels import ops
from peerline.kernels.capture_state import capturing
from peerline.kernels.cross_entropy import cross_entropy
from peerline.kernels.fused_linear import FusedLinear
from peerline.kernels.layer_norm import FusedLayerNorm

log = logging.getLogger(__name__)


class ResidualMLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)) + b1)). fc1 has no bias of its own: its bias goes into the fused bias+GELU kernel,
    or into fc1's GEMM epilogue where the block runs torch's ops (forward_torch_ops: --kernels torch, the CPU).

    fc1/fc2 are nn.Linear subclasses (same parameters, init and state_dict); with kernels="peerline" their weight
    gradients are accumulated straight into the fp32 .grad (kernels/fused_linear.py). The norm is nn.LayerNorm's
    subclass FusedLayerNorm: one kernel forward and one backward for bf16 activations and parameters
    (kernels/layer_norm.py), torch's layer_norm otherwise; where its kernels run, its backward also adds the
    residual's gradient into x's and sums fc2's bias gradient (FusedLayerNorm.with_residual)."""

    def __init__(self, hidden: int, kernels: str = "torch") -> None:
        super().__init__()
        self.norm = FusedLayerNorm(hidden, impl=kernels)
        self.fc1 = FusedLinear(hidden, 4 * hidden, bias=False, impl=kernels)
        self.fc1_bias = nn.Parameter(torch.empty(4 * hidden).uniform_(-hidden ** -0.5, hidden ** -0.5))
        self.fc2 = FusedLinear(4 * hidden, hidden, impl=kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "torch":  # torch's ops throughout (the CPU, --kernels torch): the direct path
            return self.forward_torch_ops(x)
        if self.kernels == "auto" and x.is_cuda and not capturing():
            p = self.torch_ops_params()
            if ops.mlp_block_on_torch(x, p.fc1_weight, p.fc1_bias, p.fc2_weight):
                return self.forward_torch_ops(x, p)
        return ops.pre_norm_mlp(x, self.norm, self.fc1, self.fc1_bias, self.fc2, self.kernels)

    def torch_ops_params(self) -> BlockParams:
        """The block's parameters, read from the modules' own dictionaries: nn.Module's attribute fallback costs
        more host time than the rest of the direct path's lookup."""
        modules = self._modules
        norm, fc1, fc2 = modules["norm"], modules["fc1"], modules["fc2"]
        n, w1, w2 = norm._parameters, fc1._parameters, fc2._parameters
        return BlockParams(norm, n["weight"], n["bias"], w1["weight"], self._parameters["fc1_bias"], w2["weight"],
                           w2["bias"])

    def forward_torch_ops(self, x: torch.Tensor, p: BlockParams | None = None) -> torch.Tensor:
        """The block in torch's ops, called directly: LayerNorm, F.linear with fc1's bias in the epilogue, GELU,
        F.linear, the add. What --kernels torch runs, and what --kernels auto picks one by one for an eager,
        host-bound launch (ops.mlp_block_on_torch)."""
        p = p or self.torch_ops_params()
        h = F.layer_norm(x, p.norm.normalized_shape, p.norm_weight, p.norm_bias, p.norm.eps)
        return x + F.linear(F.gelu(F.linear(h, p.fc1_weight, p.fc1_bias)), p.fc2_weight, p.fc2_bias)


class BlockParams(NamedTuple):
    """A residual-MLP block's LayerNorm and parameters, as its direct path reads them."""

    norm: nn.LayerNorm
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor


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


def load_spec(spec: str, what: str) -> Callable:
    """Import 'pkg.module:name'; one ConfigError line when it is not there, does not compile, or its import
    fails (user code: any exception, sys.exit and KeyboardInterrupt included)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {what} {spec!r}: {exc}") from None
    except SyntaxError as exc:
        raise ConfigError(f"cannot load {what} {spec!r}: SyntaxError in {exc.filename}, line {exc.lineno}: "
                          f"{exc.msg}") from None
    except BaseException as exc:  # noqa: BLE001 - user code at import time
        raise ConfigError(f"cannot load {what} {spec!r}: importing {module_name!r} {user_failure(exc)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "has no" if fn is None else f"has a {type(fn).__name__}, not a callable, as"
        raise ConfigError(f"cannot load {what} {spec!r}: module {module_name!r} {found} {attr!r}")
    return fn


def user_failure(exc: BaseException) -> str:
    """How user code failed, for one line: 'called sys.exit(7)', 'was interrupted (KeyboardInterrupt)',
    'raised ValueError: ...' (the first line of the message)."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "was interrupted (KeyboardInterrupt)"
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"raised {type(exc).__name__}" + (f": {text}" if text else "")


def call_with_wanted(fn: Callable, available: dict[str, object]) -> tuple[object, set[str]]:
    """Call `fn` with the keyword arguments it names among `available` (all of them when it takes **kwargs);
    returns its result and the names it took."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    taken = set(available) if takes_all else set(available) & set(params)
    return fn(**{k: available[k] for k in taken}), taken


@dataclass
class UserModel:
    """What a factory gave: the whole model's layers (an nn.Sequential's), or one builder per layer; and the run
    values it took (`taken`: flags it ignores get a notice)."""

    spec: str
    layers: list[nn.Module] | None = None
    builders: list[Callable[[], nn.Module]] | None = None
    taken: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.layers if self.layers is not None else self.builders)

    def build(self, start: int, stop: int, seed: int) -> list[nn.Module]:
        """Layers [start, stop): sliced from the whole model, or built each under its own seed."""
        if self.layers is not None:
            return self.layers[start:stop]
        built = []
        for i in range(start, stop):
            torch.manual_seed(layer_seed(seed, i))
            try:  # this rank's builders only: a failure is this rank's alone (RankConfigError)
                layer = _call_user(self.spec, self.builders[i], f"layer builder {i} of ")
            except ConfigError as exc:
                raise RankConfigError(str(exc)) from None
            if not isinstance(layer, nn.Module):
                raise RankConfigError(f"layer builder {i} of {self.spec!r} returned {type(layer).__name__}, not an "
                                      "nn.Module")
            built.append(layer)
        return built


def _call_user(spec: str, fn: Callable[[], object], what: str = "") -> object:
    try:
        return fn()
    except ConfigError:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is reported as one line
        raise ConfigError(f"{what}model factory {spec!r} {user_failure(exc)}") from None


def run_values(cfg: RunConfig, vocab: int) -> dict[str, object]:
    """The run's values a user factory may ask for by keyword."""
    return {"vocab_size": vocab, "vocab": vocab, "hidden": cfg.hidden, "seq": cfg.seq, "heads": cfg.heads,
            "layers": cfg.layers, "seed": cfg.seed, "micro_batch_size": cfg.micro_batch_size}


def load_user_model(spec: str, seed: int, values: dict[str, object] | None = None) -> UserModel:
    """Import 'pkg.module:factory' and call it under the run's seed with the `values` it names; it returns an
    nn.Sequential, a list of nn.Modules (taken as one) or a list of per-layer builders (callables returning one
    nn.Module each)."""
    factory = load_spec(spec, "model factory")
    torch.manual_seed(seed)
    try:
        made, taken = call_with_wanted(factory, values or {})
    except ConfigError:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of user code (sys.exit too) is one line
        raise ConfigError(f"model factory {spec!r} {user_failure(exc)}") from None
    if isinstance(made, nn.Sequential):
        return UserModel(spec, layers=list(made), taken=taken)
    items = list(made) if isinstance(made, list | tuple | nn.ModuleList) else None
    if items and all(isinstance(m, nn.Module) for m in items):  # the layers, in order: as an nn.Sequential's
        return UserModel(spec, layers=items, taken=taken)
    if items and all(callable(b) and not isinstance(b, nn.Module) for b in items):
        return UserModel(spec, builders=items, taken=taken)
    raise ConfigError(f"model factory {spec!r} returned {describe_returned(made)}; {FACTORY_RETURNS}")


FACTORY_RETURNS = ("a factory returns an nn.Sequential, a list of nn.Modules (the layers, in order), or a list of "
                   "layer builders (functions without arguments that return one nn.Module each; each rank calls "
                   "only those of its own layers)")


def describe_returned(made: object) -> str:
    """What a factory returned, for its error line: the type, or a list's mix of modules and other items."""
    if not isinstance(made, list | tuple | nn.ModuleList):
        return type(made).__name__
    kind = type(made).__name__
    if not made:
        return f"an empty {kind}"
    other = next((i for i, m in enumerate(made) if not callable(m)), None)  # nn.Modules are callable
    if other is not None:
        return f"a {kind} whose item {other} is {type(made[other]).__name__}, neither an nn.Module nor a builder"
    module = next(i for i, m in enumerate(made) if isinstance(m, nn.Module))
    builder = next(i for i, m in enumerate(made) if not isinstance(m, nn.Module))
    return f"a {kind} that mixes nn.Modules (item {module}) and builders (item {builder})"


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
    """Contiguous split that minimises the heaviest stage (weights: parameters or FLOPs per layer). Exact dynamic
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


def build_stages(cfg: RunConfig, n_stages: int, stage_ids: list[int], kernels: str, vocab: int = 4096,
                 notices: list[str] | None = None) -> tuple[list[nn.Sequential], list[tuple[int, int]]]:
    """The stage modules this rank runs (stage_ids of n_stages) and the split of the whole model: the residual-MLP
    model split evenly, or a user model (its nn.Sequential split by parameters; its builders split evenly, each
    rank building only its own layers; `notices` gets its notices). --model gpt is built by assemble.py (models/
    sits above this module)."""
    if cfg.model is None:
        bounds = split_even(cfg.layers, n_stages)
        stages = [nn.Sequential(*build_default_layers(cfg, *bounds[s], kernels)) for s in stage_ids]
        return stages, bounds
    user = load_user_model(cfg.model, cfg.seed, run_values(cfg, vocab))
    if user.layers is not None:
        bounds = split_by_weight([sum(p.numel() for p in layer.parameters()) for layer in user.layers], n_stages)
        check_shared(cfg.model, user.layers, bounds)
    else:
        bounds = split_even(len(user), n_stages)
    try:
        stages = [nn.Sequential(*user.build(*bounds[s], cfg.seed)) for s in stage_ids]
        if user.layers is None:  # this rank's stages, one after the other
            ends = [sum(len(stage) for stage in stages[:k + 1]) for k in range(len(stages))]
            check_shared(cfg.model, [layer for stage in stages for layer in stage],
                         [(end - len(stage), end) for stage, end in zip(stages, ends)],
                         [bounds[s][0] for s in stage_ids], stage_ids)
        check_trainable(cfg.model, user.layers, stages, stage_ids, bounds)
    except ConfigError as exc:
        if user.layers is not None:
            raise  # a whole model: every rank finds the same
        # builders run on their own rank only: the line names the rank
        raise RankConfigError(f"rank {launch_rank_world()[0]} ({_stages_label(stage_ids)}): {exc}") from None
    if notices is not None:
        notices += user_model_notices(cfg, user.taken, user.layers if user.layers is not None else stages)
    return stages, bounds


def check_trainable(spec: str, layers: list[nn.Module] | None, stages: list[nn.Sequential], stage_ids: list[int],
                    bounds: list[tuple[int, int]]) -> None:
    """Every stage needs parameters (the optimizer of its rank has nothing to train otherwise). A whole model is
    checked alike on every rank; builders' layers exist only on their rank, which reports its own stage."""
    if layers is not None:
        if not any(p.requires_grad for layer in layers for p in layer.parameters()):
            raise ConfigError(f"the model of {spec!r} has no trainable parameters: nothing to train")
        empty = [s for s, (a, b) in enumerate(bounds) if not any(p.requires_grad for m in layers[a:b]
                                                                 for p in m.parameters())]
        where = None if not empty else empty[0]
    else:
        where = next((sid for sid, m in zip(stage_ids, stages) if not any(p.requires_grad for p in m.parameters())),
                     None)
    if where is not None:
        a, b = bounds[where]
        error = ConfigError if layers is not None else RankConfigError
        raise error(f"stage {where} of {spec!r} (layers {a}-{b - 1}) has no trainable parameters: every stage needs "
                    "some; use fewer stages or move a layer with parameters into it")


def check_shared(spec: str, layers: list[nn.Module], bounds: list[tuple[int, int]],
                 first_layers: list[int] | None = None, stage_ids: list[int] | None = None) -> None:
    """No parameter may be shared by layers of two stages: each stage would train its own copy of it (its rank's
    optimizer, its own gradient), silently untied. `bounds` index `layers`; `first_layers` and `stage_ids` name
    them in the whole model (default: `layers` is the whole model, stage s its bounds[s])."""
    first_layers = first_layers or [a for a, _ in bounds]
    stage_ids = stage_ids or list(range(len(bounds)))
    owner: dict[int, tuple[int, int, str]] = {}  # id(parameter) -> (stage, layer in the whole model, its name)
    for (a, b), first, sid in zip(bounds, first_layers, stage_ids):
        for i in range(a, b):
            for pname, param in layers[i].named_parameters():
                at = (sid, first + i - a, pname)
                seen = owner.setdefault(id(param), at)
                if seen[0] != sid:
                    raise ConfigError(
                        f"layers {seen[1]} and {at[1]} of {spec!r} share one parameter (layer {seen[1]}'s "
                        f"{seen[2]!r} is layer {at[1]}'s {pname!r}), but they sit on different stages ({seen[0]} "
                        f"and {sid}): each stage would train its own copy; put both layers on one stage, or give "
                        "each its own parameter (the GPT ties its embeddings across stages with --tie-embeddings)")


def _stages_label(stage_ids: list[int]) -> str:
    return f"stage {stage_ids[0]}" if len(stage_ids) == 1 else f"stages {', '.join(map(str, stage_ids))}"


def user_model_notices(cfg: RunConfig, taken: set[str], modules: list[nn.Module]) -> list[str]:
    """One-line notices about a user model: size flags it ignores, dropout that makes results depend on the split."""
    notices = []
    defaults = RunConfig.__dataclass_fields__
    sized = ("layers", "heads", "hidden") if cfg.token_data else ("layers", "heads")  # --hidden sizes float data
    ignored = [f"--{name}" for name in sized
               if getattr(cfg, name) != defaults[name].default and name not in taken]
    if ignored:
        notices.append(f"{' and '.join(ignored)} not applied: the model factory {cfg.model!r} does not take "
                       f"{'it' if len(ignored) == 1 else 'them'}")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for module in modules for m in module.modules()):
        notices.append("the model has dropout: its random masks, and so the results, then depend on the stage split")
    return notices


def mlp_flops_per_token(cfg: RunConfig) -> float:
    """Model FLOPs of one trained token of the residual-MLP model: 6 x its matmul weights (fc1 and fc2 hold
    8 H^2 per block), forward and backward, nothing else counted."""
    return 6.0 * 8 * cfg.hidden * cfg.hidden * cfg.layers


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Next-token cross-entropy in fp32: logits [B, T, V] against int64 labels [B, T], mean over tokens; bf16
    logits are never copied whole to fp32: two kernels on a GPU, chunks of torch ops with `impl` "torch" and on
    the CPU (kernels/cross_entropy.py)."""
    return cross_entropy(output, target, impl=impl)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 against the float targets (the residual-MLP model's loss)."""
    return F.mse_loss(output.float(), target)


def make_loss(spec: str, kernels: str = "auto") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """--loss: mse, cross-entropy, or a user function 'pkg.module:fn' (output, target) -> scalar mean loss.
    `kernels` is --kernels: "torch" keeps the cross-entropy in torch ops."""
    if spec == "cross-entropy" and kernels == "torch":
        return functools.partial(cross_entropy_loss, impl="torch")
    builtin = {"mse": mse_loss, "cross-entropy": cross_entropy_loss}
    return builtin[spec] if spec in builtin else load_spec(spec, "loss function")


def loss_check(cfg: RunConfig, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> Callable[[object], None] | None:
    """For a user --loss: a check of the last stage's start-up output (pipeline/boundary_shapes.py), that the loss
    function turns it and a target like the run's into a loss training can use; None for the built-in losses."""
    if cfg.loss in LOSSES:
        return None

    def check(output: object) -> None:
        if cfg.token_data:  # next-token labels, as the token feed fills them
            target = torch.zeros((cfg.micro_batch_size, cfg.seq), dtype=torch.int64, device=_device_of(output))
        elif isinstance(output, torch.Tensor):  # float targets shaped like the output, as DataFeed fills them
            target = torch.randn(output.shape, device=output.device)
        else:
            return  # a structured output with float data has no target the run could make
        check_loss(cfg.loss, loss_fn, _grad_leaves(output), target)
    return check


def check_loss(spec: str, loss_fn: Callable, output: object, target: torch.Tensor) -> None:
    """The loss of one microbatch must be what training sums and differentiates: a 0-dim floating-point tensor
    computed from the output. One ConfigError line naming the function and what it returned otherwise."""
    what = f"the loss function {spec!r}"
    given = f"for output {describe_tensors(output)} and target {describe_tensors(target)}"
    try:
        with torch.enable_grad():
            loss = loss_fn(output, target)
    except Exception as exc:  # noqa: BLE001 - user code: one line
        raise ConfigError(f"{what} {user_failure(exc)} {given}") from None
    need = "it must return the microbatch's mean loss as a 0-dim floating-point tensor"
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{what} returned {type(loss).__name__} {given}; {need}")
    if loss.dim() != 0:
        raise ConfigError(f"{what} returned {describe_tensors(loss)} {given}, not one value; {need} (e.g. the .mean() "
                          "of the per-element losses)")
    if not loss.is_floating_point():
        raise ConfigError(f"{what} returned {describe_tensors(loss)} {given}; {need}: no gradient flows back "
                          "through an integer")
    if not loss.requires_grad:
        raise ConfigError(f"{what} returned a loss that does not depend on the output {given} (no gradient "
                          "reaches the model); compute it from the output without .detach(), .item() or numpy")


def describe_tensors(x: object) -> str:
    """'float32 [2, 4]' for a tensor, '(float32 [2, 4], int64 [2])' for a tuple or list, the type otherwise."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe_tensors(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {describe_tensors(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def _grad_leaves(x: object) -> object:
    """`x` with its floating-point tensors detached and requiring grad (the probe ran without autograd)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    if isinstance(x, tuple | list):
        return type(x)(_grad_leaves(v) for v in x)
    if isinstance(x, dict):
        return {k: _grad_leaves(v) for k, v in x.items()}
    return x


def _device_of(x: object) -> torch.device:
    if isinstance(x, torch.Tensor):
        return x.device
    values = x.values() if isinstance(x, dict) else x if isinstance(x, tuple | list) else ()
    return next((_device_of(v) for v in values), torch.device("cpu"))


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
