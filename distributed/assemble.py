"""Assembles one rank's run, once: launcher -> grid -> model -> process groups -> streams -> transport -> engine.

`assemble(cfg, info)` runs the steps below in this order and returns the parts (`RunParts`) a Runtime trains
with. The order matters: everything that can be a user error (the grid, the schedule, the model or a user factory)
is checked before any process group exists, so every rank fails alike and nobody waits in a collective; the
stage shapes are agreed with the neighbours before the transport is sized; every rank checks the whole schedule
against the transport it will run on before the first step.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig, is_spec
from peerline.distributed.cudagraph.policy import GraphPolicy
from peerline.distributed.data.token_feed import SYNTHETIC_VOCAB, TokenData, make_token_feed, token_data
from peerline.distributed.env import LaunchInfo, choose_device, detect_launch, init_distributed
from peerline.distributed.grad_sync.per_param import PerParameterAllReduce
from peerline.distributed.grad_sync.sharded_adamw import full_param_names, make_adamw
from peerline.distributed.grad_sync.tied import TiedGradSum, tied_pair
from peerline.distributed.hooks import IterationHooks, TimelineWriter
from peerline.distributed.mesh import Mesh
from peerline.distributed.model import (
    build_stages,
    describe_split,
    loss_check,
    make_loss,
    mlp_flops_per_token,
    split_by_weight,
)
from peerline.distributed.observe.timeline import Timeline
from peerline.distributed.p2p.base import Links, TensorSpec, Transport
from peerline.distributed.p2p.edges import COPY_ENGINE, Edge, describe_edges
from peerline.distributed.p2p.factory import make_edge_transport
from peerline.distributed.pipeline import schedule as sched
from peerline.distributed.pipeline.boundary import BoundarySpec
from peerline.distributed.pipeline.boundary_shapes import (
    check_layer_output,
    exchange_boundary_specs,
    exchange_placed_specs,
)
from peerline.distributed.pipeline.engine import CounterDataFeed, DataFeed, Engine, GradSync, LocalStage
from peerline.distributed.pipeline.placed import PlacedSchedule, placed_links, placed_schedule
from peerline.distributed.pipeline.recompute import with_recompute
from peerline.distributed.precision import apply_precision, resolve_autocast
from peerline.distributed.streams import RankStreams, create_rank_streams
from peerline.kernels import ops
from peerline.models.flops import gpt_flops_per_token, gpt_layer_costs
from peerline.models.gpt import build_gpt_layers, describe_gpt_split

log = logging.getLogger(__name__)


@dataclass
class Grid:
    """Where this rank sits: its device, the mesh, the global stage ids it holds and the schedule's programs."""

    info: LaunchInfo
    device: torch.device
    mesh: Mesh
    n_stages: int
    stage_ids: list[int]
    programs: list[list[sched.Step]]
    placed: PlacedSchedule | None = None  # several stages per rank over several ranks: the rank programs


@dataclass
class RunParts:
    """Everything a Runtime trains with, built once by `assemble`."""

    cfg: RunConfig
    grid: Grid
    engine: Engine
    streams: RankStreams
    links: Links
    split: str  # which layers each stage holds, for the start line
    layer_offsets: dict[int, int]  # global stage id -> index of its first layer in the whole model
    graphs: GraphPolicy
    hooks: list[IterationHooks] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # one line each for the start of the run (rank 0 prints)
    flops_per_token: float | None = None  # model FLOPs of one trained token (None: unknown, a user model)
    workload: str = ""  # the model, its data and vocabulary, for the start line


@dataclass
class Workload:
    """This rank's share of the model (on the CPU, not yet recomputing) and what feeds it."""

    modules: list[nn.Sequential]
    bounds: list[tuple[int, int]]  # [start, stop) layers of every stage of the whole model
    vocab: int
    tokens: TokenData | None  # None: synthetic float data
    flops_per_token: float | None
    notices: list[str]


def assemble(cfg: RunConfig, info: LaunchInfo | None = None) -> RunParts:
    """Build one rank's run (collective over every rank of the launch)."""
    grid = plan_grid(cfg, info)
    kernels = ops.resolve_impl(cfg.kernels, grid.device)
    work = make_model(cfg, grid, kernels)
    start_process_groups(cfg, grid)
    streams = make_streams(cfg, grid.device)
    modules = [with_recompute(m.to(grid.device), cfg.recompute_layers) for m in work.modules]
    apply_precision(cfg, modules, 0 if grid.stage_ids[0] == 0 else None, grid.device)
    autocast_dtype = resolve_autocast(cfg, grid.device)
    first_in = first_input_spec(cfg)
    in_specs, out_specs, links = probe_and_link(cfg, grid, modules, work, first_in, autocast_dtype)
    transport, program = make_checked_transport(cfg, grid, links, streams, work.notices)
    stages = make_stages(cfg, grid, modules, out_specs, streams)
    for stage, in_spec in zip(stages, in_specs):  # what each stage receives (the engine links adjacent local ones)
        stage.in_spec = in_spec
    layer_offsets = {sid: work.bounds[sid][0] for sid in grid.stage_ids}
    if cfg.shard_optimizer and grid.mesh.dp == 1:
        work.notices.append("--shard-optimizer: dp=1 has no replicas to shard over; the optimizer is unsharded")
    note = grid.placed.order_note() if grid.placed is not None else None
    if note:
        work.notices.append(note)
    engine = make_engine(cfg, grid, stages, program, transport, streams, first_in, out_specs[-1], autocast_dtype,
                         tokens=work.tokens, layer_offsets=layer_offsets)
    n_params = sum(p.numel() for stage in stages for layer in stage.module for p in layer.parameters())
    split = describe_gpt_split(work.bounds, cfg.layers) if cfg.model == "gpt" else describe_split(work.bounds)
    log.info("%s; %s; %.2f M parameters here; transport %s", grid.mesh.describe(), split, n_params / 1e6,
             transport.describe())
    return RunParts(cfg=cfg, grid=grid, engine=engine, streams=streams, links=links, split=split,
                    layer_offsets=layer_offsets,
                    graphs=make_graph_policy(cfg, grid), hooks=make_hooks(cfg), notices=work.notices,
                    flops_per_token=work.flops_per_token, workload=describe_workload(cfg, work))


# -- the steps, in the order assemble() runs them --------------------------------------------------------------

def plan_grid(cfg: RunConfig, info: LaunchInfo | None) -> Grid:
    """The allocator (checked against the backend torch loaded with), the launch, the grid and the schedule: all
    checked before any process group exists, so nothing can hang."""
    from peerline.distributed.memory.allocator import configure_allocator

    configure_allocator(cfg.allocator, cfg.pool_release_threshold)
    info = info or detect_launch()
    pp = cfg.resolved_pp(info.world_size)
    n_stages = pp * cfg.stages
    placed = placed_schedule(cfg.schedule, pp, cfg.stages, cfg.microbatches, cfg.zb_memory,  # interleaved, zbv
                             cfg.zb_order)
    # validates M against the stages
    programs = placed.stage_programs() if placed else sched.build(cfg.schedule, n_stages, cfg.microbatches,
                                                                  memory=cfg.zb_memory)
    device = choose_device(cfg.device, info)
    mesh = Mesh(pp=pp, dp=cfg.dp, rank=info.rank, wrap=placed is not None and placed.placement.wraps)
    stage_ids = placed.placement.stages_of(mesh.stage) if placed else \
        [mesh.stage * cfg.stages + i for i in range(cfg.stages)]
    return Grid(info, device, mesh, n_stages, stage_ids, programs, placed)


def make_model(cfg: RunConfig, grid: Grid, kernels: str) -> Workload:
    """The data source (token data: resolved on every rank, tokenized once) and this rank's stages of the model:
    the GPT (split by compute), the residual-MLP model or a user model (model.py). Before any process group, so a
    bad model or data path fails on every rank alike."""
    tokens = token_data(cfg) if cfg.token_data else None
    vocab = tokens.vocab if tokens is not None else (cfg.vocab or SYNTHETIC_VOCAB)
    notices: list[str] = []
    if cfg.model == "gpt":
        costs = gpt_layer_costs(vocab=vocab, hidden=cfg.hidden, layers=cfg.layers, seq=cfg.seq)
        bounds = split_by_weight(costs, grid.n_stages)
        modules = [nn.Sequential(*build_gpt_layers(
            vocab=vocab, hidden=cfg.hidden, heads=cfg.heads, layers=cfg.layers, seq=cfg.seq, seed=cfg.seed,
            kernels=kernels, start=bounds[s][0], stop=bounds[s][1], tie_embeddings=cfg.tie_embeddings))
            for s in grid.stage_ids]
        flops = gpt_flops_per_token(vocab=vocab, hidden=cfg.hidden, layers=cfg.layers, seq=cfg.seq)
    else:
        modules, bounds = build_stages(cfg, grid.n_stages, grid.stage_ids, kernels, vocab, notices)
        flops = mlp_flops_per_token(cfg) if cfg.model is None else None
    return Workload(modules, bounds, vocab, tokens, flops, notices)


def describe_workload(cfg: RunConfig, work: Workload) -> str:
    """The model, its data and the vocabulary, for the start line: 'model gpt (4 blocks, hidden 128, 4 heads,
    seq 128); data text: ...; vocabulary 4096'."""
    if cfg.model == "gpt":
        tied = ", tied embeddings" if cfg.tie_embeddings else ""
        model = f"gpt ({cfg.layers} blocks, hidden {cfg.hidden}, {cfg.heads} heads, seq {cfg.seq}{tied})"
    elif cfg.model is None:
        model = f"residual MLP ({cfg.layers} blocks, hidden {cfg.hidden})"
    else:
        model = f"{cfg.model} ({work.bounds[-1][1]} layers)"
    if work.tokens is None:
        return f"model {model}; data {cfg.data} (synthetic floats)"
    return f"model {model}; data {work.tokens.name}; vocabulary {work.vocab}"


def first_input_spec(cfg: RunConfig) -> TensorSpec:
    """What the first stage reads: token ids int64 [B, T], or synthetic floats [B, T, hidden]."""
    if cfg.token_data:
        return TensorSpec((cfg.micro_batch_size, cfg.seq), torch.int64)
    return TensorSpec((cfg.micro_batch_size, cfg.seq, cfg.hidden), torch.float32)


def dp_group_options(cfg: RunConfig) -> object | None:
    """NCCL options of the dp groups: --nccl-max-ctas caps the SMs the overlapped bucket all-reduces take from
    backward (0: NCCL's default). None (no cap, or not NCCL) keeps the backend's defaults."""
    if not cfg.nccl_max_ctas or not dist.is_initialized():
        return None
    from peerline.distributed.grad_sync.buckets import nccl_options

    return nccl_options(cfg.nccl_max_ctas, backend=dist.get_backend())  # None for gloo


def start_process_groups(cfg: RunConfig, grid: Grid) -> None:
    """The default process group, then the mesh's dp groups."""
    init_distributed(grid.info, grid.device, cfg.timeout_s)
    grid.mesh.create_groups(dp_options=dp_group_options(cfg))
    if cfg.tie_embeddings:
        grid.mesh.create_embedding_groups()


def make_streams(cfg: RunConfig, device: torch.device) -> RankStreams:
    """This rank's streams; on a GPU also the async pool's release threshold (a no-op under the caching one)."""
    streams = create_rank_streams(device, cfg.stages, p2p_lanes=cfg.p2p_lanes,
                                  allreduce_priority=cfg.allreduce_priority)
    if device.type == "cuda":
        from peerline.distributed.memory.allocator import apply_release_threshold

        apply_release_threshold(device, cfg.pool_release_threshold)
    return streams


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def probe_boundaries(cfg: RunConfig, grid: Grid, modules: list[nn.Sequential], work: Workload,
                     first_in: TensorSpec, autocast_dtype: torch.dtype | None) -> tuple[BoundarySpec, list]:
    """Every stage boundary's spec, from one forward per stage (pipeline/boundary_shapes.py), with the layers run
    one by one so a model that does not fit its input fails as one line naming the layer; then the last stage's
    output is checked against the loss (a user --loss scores it once, every rank agreeing on the outcome)."""
    probes = [LayerProbe(m, work.bounds[sid][0]) for m, sid in zip(modules, grid.stage_ids)]
    in_spec, out_specs = exchange_boundary_specs(probes, first_in, grid.mesh.prev_rank, grid.mesh.next_rank,
                                                 grid.device, lambda: autocast_context(grid.device, autocast_dtype),
                                                 first_index=grid.stage_ids[0],
                                                 end_check=loss_check(cfg, make_loss(cfg.loss, cfg.kernels)))
    if grid.stage_ids[-1] == grid.n_stages - 1 and cfg.loss == "cross-entropy":
        check_logits(out_specs[-1], cfg, work.vocab)
    return in_spec, out_specs


def probe_and_link(cfg: RunConfig, grid: Grid, modules: list[nn.Sequential], work: Workload, first_in: TensorSpec,
                   autocast_dtype: torch.dtype | None) -> tuple[list[BoundarySpec], list[BoundarySpec], Links]:
    """Every local stage's input and output spec (the input of the first only, unless stages are placed over
    several ranks) and this rank's links."""
    if grid.placed is None:
        in_spec, out_specs = probe_boundaries(cfg, grid, modules, work, first_in, autocast_dtype)
        return [in_spec], out_specs, make_links(grid.mesh, in_spec, out_specs[-1])
    probes = [LayerProbe(m, work.bounds[sid][0]) for m, sid in zip(modules, grid.stage_ids)]
    mesh = grid.mesh
    ins, outs = exchange_placed_specs(probes, grid.stage_ids,
                                      lambda s: mesh.rank_of(grid.placed.placement.rank_of(s), mesh.replica),
                                      grid.n_stages, first_in, grid.device,
                                      lambda: autocast_context(grid.device, autocast_dtype),
                                      end_check=loss_check(cfg, make_loss(cfg.loss, cfg.kernels)))
    if grid.n_stages - 1 in outs and cfg.loss == "cross-entropy":
        check_logits(outs[grid.n_stages - 1], cfg, work.vocab)
    links = placed_links(grid.placed, mesh.stage, mesh.prev_rank, mesh.next_rank, ins, outs)
    return [ins[s] for s in grid.stage_ids], [outs[s] for s in grid.stage_ids], links


class LayerProbe(nn.Module):
    """A stage's layers run one by one for the start-up probe: an exception becomes one ConfigError line naming
    the layer (its index in the whole model and its class) and what it was given."""

    def __init__(self, stage: nn.Sequential, first_layer: int) -> None:
        super().__init__()
        self.stage, self.first_layer = stage, first_layer

    def forward(self, x: object) -> object:
        for i, layer in enumerate(self.stage):
            try:
                x, before = layer(x), x
                check_layer_output(before, x, self.first_layer + i, layer, describe_value)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - a model that does not fit its data is a user error
                reason = (str(exc).strip().splitlines() or [""])[0]
                raise ConfigError(f"the model does not fit its input: layer {self.first_layer + i} "
                                  f"({type(layer).__name__}) got {describe_value(x)}: {type(exc).__name__}: "
                                  f"{reason}") from None
        return x


def describe_value(x: object) -> str:
    """'int64 [2, 32]' for a tensor; the leaves of a tuple, list or dict of tensors."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe_value(v) for v in x) + ")"
    return type(x).__name__


def check_logits(out: object, cfg: RunConfig, vocab: int) -> None:
    """Cross-entropy scores float logits [B, T, V >= vocab] against the labels [B, T]."""
    shape, dtype = tuple(out.shape), out.dtype
    want = (cfg.micro_batch_size, cfg.seq)
    if len(shape) != 3 or shape[:2] != want or not dtype.is_floating_point:
        raise ConfigError(f"the model's output {str(dtype).removeprefix('torch.')} {list(shape)} cannot be scored "
                          f"by cross-entropy: it needs float logits [{want[0]}, {want[1]}, vocab]")
    if shape[2] < vocab:
        raise ConfigError(f"the model's output has {shape[2]} logits per token, fewer than the data's vocabulary "
                          f"of {vocab} token ids (--vocab)")


def make_links(mesh: Mesh, in_spec: BoundarySpec, out_spec: BoundarySpec) -> Links:
    """This rank's pipeline edges: the messages it receives from the previous stage and from the next (a
    boundary of several tensors travels packed, pipeline/boundary.py)."""
    return Links(prev_rank=mesh.prev_rank, next_rank=mesh.next_rank,
                 act_in=in_spec.message if mesh.prev_rank is not None else None,
                 grad_in=out_spec.grad_message if mesh.next_rank is not None else None)


def whole_w_first_stage(cfg: RunConfig, device: torch.device) -> bool:
    """Whether zb-h1's copy-engine order may take the first stage's B as nothing and its W as the whole backward
    (split_backward's graph form: plain Linears, the CPU, eager runs). Not where every rank expects the lean form:
    a built-in model, whose Linears are fused, captured on a GPU with peerline's kernels; there the first stage's
    B is a real backward, and the rendezvous order (timed.py with every stage's unit costs) is the shorter one
    (pp=4, M=8: 27 units against 28)."""
    lean = (device.type == "cuda" and cfg.graph is not False and not (cfg.model and is_spec(cfg.model))
            and ops.resolve_impl(cfg.kernels, device) != "torch")
    return not lean


def make_checked_transport(cfg: RunConfig, grid: Grid, links: Links, streams: RankStreams,
                           notices: list[str] | None = None) -> tuple[Transport, list[tuple[int, sched.Step]]]:
    """The transport (one per edge: p2p/edges.py), and this rank's share of the schedule in global order,
    simulated against its capacity. The edges' transports and hosts go to `notices` (the start-up lines)."""
    on_gpu = grid.device.type == "cuda"
    placed = grid.placed
    ring = None if placed else sched.build(cfg.schedule, grid.n_stages, cfg.microbatches,
                                           rendezvous=not whole_w_first_stage(cfg, grid.device), memory=cfg.zb_memory)
    # ring depth (copy engine): what the schedule needs plus one slot, so the next message's copy overlaps the
    # receiver's work instead of waiting for its release; never more than the messages of an edge
    ids = placed.ids if placed else cfg.microbatches
    need = placed.min_capacity() if placed else max(sched.min_capacity(grid.programs), sched.min_capacity(ring))
    depth = min(ids, 1 + need)
    transport, edges = make_edge_transport(cfg.p2p, links, grid.device, ids,
                                           streams=streams, capture_safe=on_gpu and cfg.graph is not False,
                                           split=cfg.p2p_split, decoupled=cfg.p2p_decoupled, depth=depth)
    if notices is not None and edges:
        notices.append(describe_edges(edges))
    if placed is not None:
        return transport, placed.program_of(grid.mesh.stage, transport.capacity)  # played against the capacity
    grid.programs = programs_for_edges(grid.programs, ring, edges)
    order = sched.simulate(grid.programs, transport.capacity)
    return transport, [(s, step) for s, step in order if s in grid.stage_ids]


def programs_for_edges(rendezvous: list[list[sched.Step]], ring: list[list[sched.Step]], edges: list[Edge]
                       ) -> list[list[sched.Step]]:
    """The ring-transport programs (schedule.zb_h1's order for the copy engine) when every edge of the job runs on
    the copy engine, else the rendezvous-safe ones. Every rank computes the same plan of edges, so every rank picks
    the same programs."""
    if edges and all(e.transport == COPY_ENGINE for e in edges):
        return ring
    return rendezvous


def make_grad_sync(cfg: RunConfig, params: list[list[nn.Parameter]], mesh: Mesh, device: torch.device,
                   streams: RankStreams) -> GradSync:
    """Bucketed all-reduce (grad_sync/buckets.py) when available, else one all-reduce per parameter."""
    if cfg.grad_sync == "buckets":
        try:
            from peerline.distributed.grad_sync.buckets import GradBuckets
            from peerline.distributed.grad_sync.sharded import ShardedGradBuckets
        except ImportError:
            log.warning("bucketed all-reduce unavailable; averaging gradients per parameter")
        else:
            dp = mesh.dp > 1
            kind = ShardedGradBuckets if cfg.shard_optimizer and dp else GradBuckets  # ZeRO-1: grad_sync/sharded.py
            return kind(params, group=mesh.dp_group if dp else None, device=device,
                        stream=streams.allreduce, bucket_mb=cfg.bucket_mb,
                        first_bucket_mb=cfg.first_bucket_mb,
                        tail_group=mesh.dp_tail_group if dp else None)
    flat = [p for layer in params for p in layer]
    return PerParameterAllReduce(flat, mesh.dp_group, mesh.dp)


def make_stages(cfg: RunConfig, grid: Grid, modules: list[nn.Module], out_specs: list[TensorSpec],
                streams: RankStreams) -> list[LocalStage]:
    """The stages this rank holds, each on its compute stream with its gradient sync."""
    stages = []
    for i, (sid, module, spec) in enumerate(zip(grid.stage_ids, modules, out_specs)):
        # stages placed over several ranks share one stream: a rank's message groups serve several stages
        stream = streams.stage_compute[0 if grid.placed and grid.mesh.pp > 1 else i]
        stage = LocalStage(index=sid, n_stages=grid.n_stages, module=module, stream=stream, out_spec=spec)
        layers = [list(layer.parameters()) for layer in module]
        stage.grad_sync = make_grad_sync(cfg, layers, grid.mesh, grid.device, streams)
        stages.append(stage)
    return stages


def make_feed(cfg: RunConfig, grid: Grid, first_in: TensorSpec, last_out: TensorSpec,
              tokens: TokenData | None = None) -> DataFeed:
    """Static input / target buffers of every microbatch (inputs on the first stage's rank, targets on the
    last's), filled from torch's seeded generator, with --data counter from a device-side counter, or with token
    data by the token feed (data/token_feed.py: int64 ids and labels through pinned host memory)."""
    device, m = grid.device, cfg.microbatches
    holds_first, holds_last = grid.stage_ids[0] == 0, grid.stage_ids[-1] == grid.n_stages - 1
    if tokens is not None:
        return make_token_feed(tokens, seed=cfg.seed, replica=grid.mesh.replica, microbatches=m,
                               micro_batch_size=cfg.micro_batch_size, seq=cfg.seq, device=device,
                               holds_first=holds_first, holds_last=holds_last)
    feed_kind, extra = DataFeed, {}
    if cfg.data == "counter":
        feed_kind, extra = CounterDataFeed, {"counter": torch.zeros(1, dtype=torch.int64, device=device)}
    return feed_kind(
        **extra, seed=cfg.seed, replica=grid.mesh.replica, microbatches=m,
        generator=torch.Generator(device=device),
        inputs=[torch.empty(first_in.shape, device=device) for _ in range(m)] if holds_first else [],
        targets=[torch.empty(last_out.shape, device=device) for _ in range(m)] if holds_last else [])


def make_engine(cfg: RunConfig, grid: Grid, stages: list[LocalStage], program: list[tuple[int, sched.Step]],
                transport: Transport, streams: RankStreams, first_in: TensorSpec, last_out: TensorSpec,
                autocast_dtype: torch.dtype | None, tokens: TokenData | None = None,
                layer_offsets: dict[int, int] | None = None) -> Engine:
    """The engine with its optimizer (fused, capturable AdamW on a GPU), its data feed (through pinned host
    staging with --staging pinned), its loss (--loss), the tied weights' gradient sum before the optimizer step
    (--tie-embeddings) and its timeline (recording only with --timeline). With --shard-optimizer over dp > 1 the
    optimizer is grad_sync/sharded_adamw.py's ShardedAdamW (parameters named by `layer_offsets`; with
    --overlap-param-gather its all-gathers overlap the next forward); with --precision compact,
    grad_sync/compact_adamw.py's CompactAdamW."""
    on_gpu = grid.device.type == "cuda"
    # Each parameter once: two layers of one stage may share a weight (AdamW would step it twice)
    params = list(dict.fromkeys(p for stage in stages for layer in stage.module for p in layer.parameters()))
    names = full_param_names({s.index: s.module for s in stages}, layer_offsets or {s.index: 0 for s in stages})
    optimizer = make_adamw(params, [s.grad_sync for s in stages], names, lr=cfg.lr, on_gpu=on_gpu,
                           precision=cfg.precision)
    feed = make_feed(cfg, grid, first_in, last_out, tokens)
    if cfg.staging == "pinned":
        from peerline.distributed.memory.staging import pinned_feed

        feed = pinned_feed(feed, streams, stages[-1], results="losses", main_stream=stages[0].stream)
    timeline = Timeline(rank=grid.info.rank, enabled=cfg.timeline is not None)
    engine = Engine(stages=stages, program=program, transport=transport, optimizer=optimizer, feed=feed,
                    microbatches=cfg.microbatches, device=grid.device, autocast_dtype=autocast_dtype,
                    timeline=timeline, loss_fn=make_loss(cfg.loss, cfg.kernels),
                    route=grid.placed.route if grid.placed is not None else None)
    tied = tied_pair([s.module for s in stages], grid.stage_ids, grid.n_stages) if cfg.tie_embeddings else []
    if tied:
        engine.before_step.append(TiedGradSum(tied, grid.mesh.embedding_group if len(tied) == 1 else None))
    if cfg.overlap_param_gather:
        overlap_param_gathers(engine, stages)
    return engine


def overlap_param_gathers(engine: Engine, stages: list[LocalStage]) -> None:
    """--overlap-param-gather: each sharded stage's all-gathers start the next iteration and its forward waits per
    bucket (grad_sync/param_gather.py); the engine's parameter barrier gathers between iterations."""
    from peerline.distributed.grad_sync.param_gather import ParamGather
    from peerline.distributed.grad_sync.sharded import ShardedGradBuckets

    for stage in stages:
        if isinstance(stage.grad_sync, ShardedGradBuckets):
            gather = ParamGather(stage.grad_sync, list(stage.module))
            engine.at_iteration_start.append(gather.start)
            engine.parameter_barriers.append(gather.gather_now)


def make_graph_policy(cfg: RunConfig, grid: Grid) -> GraphPolicy:
    return GraphPolicy(device=grid.device, rank=grid.info.rank, graph=cfg.graph, warmup_iters=cfg.warmup_iters,
                       loop=cfg.graph_loop, eager_last=cfg.timeline is not None)


def make_hooks(cfg: RunConfig) -> list[IterationHooks]:
    """The hooks the configuration itself asks for: a timeline written at the end, metrics (--metrics-jsonl,
    --tensorboard), a profile (--profile) and the engine's step ranges (--nvtx, or --profile)."""
    from peerline.distributed.observe.metrics_jsonl import MetricsJsonl
    from peerline.distributed.observe.profiler import Profiler, StepRanges
    from peerline.distributed.observe.tensorboard import TensorBoardWriter

    hooks: list[IterationHooks] = [TimelineWriter(cfg.timeline)] if cfg.timeline else []
    if cfg.metrics_jsonl:
        hooks.append(MetricsJsonl(cfg.metrics_jsonl))
    if cfg.tensorboard:
        hooks.append(TensorBoardWriter(cfg.tensorboard))
    if cfg.nvtx or cfg.profile:
        hooks.append(StepRanges(labels=cfg.profile is not None))
    if cfg.profile:
        hooks.append(Profiler(cfg.profile))
    return hooks
