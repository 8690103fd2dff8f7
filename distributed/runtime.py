"""Assembles a run: launcher -> process group -> mesh -> model -> schedule -> transport -> engine, and trains.

`Runtime.create(cfg)` does everything that happens once; `Runtime.train()` runs the iterations, reading the loss
back once per logged iteration. launch/pipeline.py and the benchmarks both build on this.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.env import LaunchInfo, choose_device, detect_launch, init_distributed
from peerline.distributed.grad_sync.per_param import PerParameterAllReduce
from peerline.distributed.mesh import Mesh
from peerline.distributed.model import build_stages, describe_split
from peerline.distributed.observe.timeline import Timeline
from peerline.distributed.p2p.transport import Links, TensorSpec, make_transport
from peerline.distributed.pipeline import schedule as sched
from peerline.distributed.pipeline.boundary_shapes import probe_specs
from peerline.distributed.pipeline.engine import CounterDataFeed, DataFeed, Engine, LocalStage
from peerline.distributed.streams import RankStreams, create_rank_streams, use
from peerline.kernels import ops

log = logging.getLogger(__name__)


@dataclass
class IterationStats:
    iteration: int
    loss: float
    ms: float
    tokens_per_s: float
    peak_mem_gb: float
    extra: dict[str, float] = field(default_factory=dict)


def dp_group_options(cfg: RunConfig):
    """NCCL options of the dp groups: --nccl-max-ctas caps the SMs the overlapped bucket all-reduces take from
    backward (0: NCCL's default). None (no cap, or not NCCL) keeps the backend's defaults."""
    if not cfg.nccl_max_ctas or not dist.is_initialized():
        return None
    from peerline.distributed.grad_sync.buckets import nccl_options

    return nccl_options(cfg.nccl_max_ctas, backend=dist.get_backend())  # None for gloo


def make_grad_sync(cfg: RunConfig, params, mesh: Mesh, device: torch.device, streams: RankStreams):
    """Bucketed all-reduce (buckets.py) when available, else one all-reduce per parameter."""
    if cfg.grad_sync == "buckets":
        try:
            from peerline.distributed.grad_sync.buckets import GradBuckets
        except ImportError:
            log.warning("bucketed all-reduce unavailable; averaging gradients per parameter")
        else:
            dp = mesh.dp > 1
            return GradBuckets(params, group=mesh.dp_group if dp else None, device=device,
                               stream=streams.allreduce, bucket_mb=cfg.bucket_mb,
                               first_bucket_mb=cfg.first_bucket_mb,
                               tail_group=mesh.dp_tail_group if dp else None)
    flat = [p for layer in params for p in layer]
    return PerParameterAllReduce(flat, mesh.dp_group, mesh.dp)


def iterations_this_launch(iteration: int, target: int, stops: tuple[int, ...], loop: int,
                           timeline_last: bool) -> int:
    """How many iterations the next launch runs: `loop` (a looped graph's K) when K iterations end at or before the
    next iteration that must end a launch (a multiple of any of `stops`: the loss read, a checkpoint) and the end
    of training, and the last iteration is not the eager one a timeline records; else 1."""
    if loop <= 1:
        return 1
    next_stop = min([target] + [(iteration // every + 1) * every for every in stops if every > 0])
    end = target - 1 if timeline_last else target
    return loop if iteration + loop <= min(next_stop, end) else 1


class Runtime:
    """Everything one rank needs to train, built once."""

    def __init__(self, cfg: RunConfig, info: LaunchInfo, device: torch.device, mesh: Mesh, engine: Engine,
                 streams: RankStreams, split: str, programs: list[list[sched.Step]], transport_name: str) -> None:
        self.cfg, self.info, self.device, self.mesh = cfg, info, device, mesh
        self.engine, self.streams, self.split, self.programs = engine, streams, split, programs
        self.transport_name = transport_name
        self.iteration = 0  # iterations completed since the start of training (a resumed run starts later)
        self.iterations_run = 0  # iterations this process ran: a resumed run warms up again before capture
        self.graph = None  # an IterationGraph once the iteration is captured (graph.py)
        self.notices: list[str] = []
        self.graph_wanted = device.type == "cuda" and cfg.graph is not False
        self.graph_failed: str | None = None
        self.graph_loop_failed: str | None = None  # why a captured graph replays one iteration per launch
        # Iteration cadences (besides --log-every) at which a looped launch must end: FailSafe adds --save-every.
        self.launch_stops: list[int] = []
        if device.type != "cuda" and cfg.graph:
            self.notices.append("--graph is ignored on the CPU (CUDA graphs need a GPU); running eager")
        if device.type != "cuda" and cfg.graph_loop > 1:
            self.notices.append(f"--graph-loop {cfg.graph_loop} is ignored on the CPU (it loops a CUDA graph); "
                                "running one iteration at a time")

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: RunConfig, info: LaunchInfo | None = None) -> Runtime:
        from peerline.distributed.memory.allocator import configure_allocator

        configure_allocator(cfg.allocator, cfg.pool_release_threshold)  # checks the backend torch loaded with
        info = info or detect_launch()
        pp = cfg.resolved_pp(info.world_size)  # checked before any process group exists: nothing can hang
        if cfg.stages > 1 and pp > 1:
            raise ConfigError(f"--stages {cfg.stages} (stages as streams of one device) needs pp=1, got pp={pp}")
        n_stages = pp * cfg.stages
        programs = sched.build(cfg.schedule, n_stages, cfg.microbatches)  # validates M against the stages
        device = choose_device(cfg.device, info)
        mesh = Mesh(pp=pp, dp=cfg.dp, rank=info.rank)
        stage_ids = [mesh.stage * cfg.stages + i for i in range(cfg.stages)]
        kernels = ops.resolve_impl(cfg.kernels, device)
        # The model is built (and a user factory checked) before any process group exists: a bad model is the
        # same error on every rank, and nobody is left waiting in a collective.
        modules, bounds = build_stages(cfg, n_stages, stage_ids, kernels)
        init_distributed(info, device, cfg.timeout_s)
        mesh.create_groups(dp_options=dp_group_options(cfg))
        streams = create_rank_streams(device, cfg.stages, p2p_lanes=cfg.p2p_lanes,
                                      allreduce_priority=cfg.allreduce_priority)
        if device.type == "cuda":
            from peerline.distributed.memory.allocator import apply_release_threshold

            apply_release_threshold(device, cfg.pool_release_threshold)
        modules = [m.to(device) for m in modules]
        dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
        autocast_dtype = torch.bfloat16 if dtype == "bf16" else None

        def autocast() -> contextlib.AbstractContextManager:
            if autocast_dtype is None:
                return contextlib.nullcontext()
            return torch.autocast(device.type, dtype=autocast_dtype)

        first_in = TensorSpec((cfg.micro_batch_size, cfg.seq, cfg.hidden), torch.float32)
        in_spec, out_specs = probe_specs(modules, first_in, mesh.prev_rank, mesh.next_rank, device, autocast)
        links = Links(prev_rank=mesh.prev_rank, next_rank=mesh.next_rank,
                      act_in=in_spec if mesh.prev_rank is not None else None,
                      grad_in=out_specs[-1] if mesh.next_rank is not None else None)
        transport = make_transport(cfg.p2p, links, device, cfg.microbatches, streams=streams,
                                   capture_safe=device.type == "cuda" and cfg.graph is not False, split=cfg.p2p_split,
                                   decoupled=cfg.p2p_decoupled)
        # Every rank checks the whole schedule against the transport it will run on, before the first step.
        order = sched.simulate(programs, transport.capacity)
        local = [(s, step) for s, step in order if s in stage_ids]

        stages = []
        all_params = []
        for sid, module, spec in zip(stage_ids, modules, out_specs):
            layers = [list(layer.parameters()) for layer in module]
            stage = LocalStage(index=sid, n_stages=n_stages, module=module, stream=streams.stage_compute[len(stages)],
                               out_spec=spec)
            stage.grad_sync = make_grad_sync(cfg, layers, mesh, device, streams)
            stages.append(stage)
            all_params += [p for layer in layers for p in layer]
        on_gpu = device.type == "cuda"
        optimizer = torch.optim.AdamW(all_params, lr=cfg.lr, fused=on_gpu or None, capturable=on_gpu)
        generator = torch.Generator(device=device)
        holds_first, holds_last = stage_ids[0] == 0, stage_ids[-1] == n_stages - 1
        feed_kind, extra = DataFeed, {}
        if cfg.data == "counter":  # made from a device-side iteration counter (counter_data.py)
            feed_kind, extra = CounterDataFeed, {"counter": torch.zeros(1, dtype=torch.int64, device=device)}
        feed = feed_kind(
            **extra, seed=cfg.seed, replica=mesh.replica, microbatches=cfg.microbatches, generator=generator,
            inputs=[torch.empty(first_in.shape, device=device) for _ in range(cfg.microbatches)] if holds_first
            else [],
            targets=[torch.empty(out_specs[-1].shape, device=device) for _ in range(cfg.microbatches)]
            if holds_last else [])
        timeline = Timeline(rank=info.rank, enabled=cfg.timeline is not None)
        engine = Engine(stages=stages, program=local, transport=transport, optimizer=optimizer, feed=feed,
                        microbatches=cfg.microbatches, device=device, autocast_dtype=autocast_dtype,
                        timeline=timeline)
        n_params = sum(p.numel() for p in all_params)
        split = describe_split(bounds)
        log.info("%s; %s; %.2f M parameters here; transport %s", mesh.describe(), split, n_params / 1e6,
                 transport.describe())
        rt = cls(cfg, info, device, mesh, engine, streams, split, programs, transport.describe())
        rt.layer_offsets = {sid: bounds[sid][0] for sid in stage_ids}
        if cfg.staging == "pinned":
            from peerline.distributed.memory.staging import attach

            attach(rt, results="losses")
        if cfg.seq_jitter > 0:
            from peerline.distributed.memory.allocator import ScratchJitter

            rt.scratch = ScratchJitter(cfg.seq_jitter, cfg.microbatches, seed=cfg.seed).install(
                [s.module for s in stages])
        return rt

    # -- training ------------------------------------------------------------------------------------------
    @property
    def tokens_per_iteration(self) -> int:
        c = self.cfg
        return c.micro_batch_size * c.seq * c.microbatches * c.dp

    def maybe_capture(self) -> None:
        """After the eager warm-up iterations, capture the iteration (every rank at the same iteration)."""
        if not self.graph_wanted or self.graph is not None or self.graph_failed is not None:
            return
        if self.iterations_run < self.cfg.warmup_iters:
            return
        if torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync":
            # Seen on 2 x H200 (2026-11-26): capture under the cudaMallocAsync backend failed with "capturing
            # stream has unjoined work", and the process then aborted in the eager fallback. Until that is
            # understood, graphs are refused up front with the reason, on every rank alike.
            self.graph_failed = "CUDA graphs are not used with --allocator async (cudaMallocAsync) yet"
            if self.info.rank == 0:
                print(f"peerline: running eager: {self.graph_failed}", flush=True)
            return
        from peerline.distributed.cudagraph.capture import try_capture

        self.graph, reason, loop_problem = try_capture(self.engine, self.device, loop=self.cfg.graph_loop)
        if self.graph is None:
            self.graph_failed = reason
            if self.info.rank == 0:
                print(f"peerline: CUDA graph capture failed, running eager on every rank: {reason}", flush=True)
        elif loop_problem is not None:
            self.graph_loop_failed = loop_problem
            if self.info.rank == 0:
                print(f"peerline: --graph-loop {self.cfg.graph_loop} not used, replaying one iteration per launch on "
                      f"every rank: {loop_problem}", flush=True)

    @property
    def graph_loop(self) -> int:
        """Iterations one host launch runs now: K once the looped graph is built (--graph-loop K), else 1."""
        return self.graph.loop_iterations if self.graph is not None and self.graph.loop is not None else 1

    def run_iteration(self, eager: bool = False) -> None:
        """Load the data of the next iteration and run it (a graph replay once graph.py captured one, unless
        `eager`: a timeline is recorded from an eager iteration, since timing events stay out of graphs)."""
        self.maybe_capture()
        with use(self.engine.main_stream):
            if self.graph is not None and not eager:
                self.graph.load(self.iteration)
                self.graph.replay()
            else:
                self.engine.feed.load(self.iteration)
                self.engine.iteration()
        self.iteration += 1
        self.iterations_run += 1

    def run_looped(self) -> int:
        """Load and run K iterations from one launch of the looped graph (only once `graph_loop` > 1); returns K."""
        if self.graph_loop <= 1:
            raise RuntimeError("run_looped needs a built graph loop (--graph-loop K > 1 on a GPU, after capture)")
        with use(self.engine.main_stream):
            k = self.graph.run_loop(self.iteration)
        self.iteration += k
        self.iterations_run += k
        return k

    def read_loss(self) -> float:
        """Mean loss of the last iteration over all microbatches and replicas (a host sync and one tiny all-reduce
        over the world: only the last stage knows the loss, and rank 0 reports it). Runs on the main stream, after
        the iteration's work: never on the legacy default stream, which does not wait for our non-blocking ones."""
        holds_last = any(s.is_last for s in self.engine.stages.values())
        with use(self.engine.main_stream):
            value = self.engine.loss_sum.detach().clone() if holds_last else torch.zeros((), device=self.device)
            if dist.is_initialized() and self.info.world_size > 1:
                dist.all_reduce(value)
            return float(value) / self.cfg.dp  # float() waits for the value

    def train(self, iters: int | None = None, on_iteration: Callable[[IterationStats], None] | None = None
              ) -> list[float]:
        """Run up to `iters` iterations counted from the start of training; return their losses."""
        target = self.cfg.iters if iters is None else iters
        losses = []
        main = self.engine.main_stream
        while self.iteration < target:
            self.maybe_capture()
            n = iterations_this_launch(self.iteration, target, (self.cfg.log_every, *self.launch_stops),
                                       self.graph_loop, timeline_last=self.cfg.timeline is not None)
            log_now = (self.iteration + n) % self.cfg.log_every == 0 or self.iteration + n == target
            t0 = time.perf_counter()
            if main is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(main)
            if n > 1:
                self.run_looped()
            else:
                self.run_iteration(eager=self.cfg.timeline is not None and self.iteration + 1 == target)
            if not log_now:
                continue
            if main is not None:
                end.record(main)
                end.synchronize()
                ms = start.elapsed_time(end) / n
            else:
                ms = (time.perf_counter() - t0) * 1e3 / n
            loss = self.read_loss()
            losses.append(loss)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if main is not None else 0.0
            stats = IterationStats(self.iteration, loss, ms, self.tokens_per_iteration / (ms / 1e3), peak)
            if on_iteration is not None:
                on_iteration(stats)
        return losses

    def close(self, timeout_s: float = 20.0) -> bool:
        """Free the transport and end the process group. Returns False when the NCCL teardown did not finish in
        `timeout_s` (the caller then exits hard rather than hang: see below)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # A captured graph holds references to the NCCL communicators it captured; ncclCommDestroy waits for them
        # (pytorch/pytorch#115388), so the graph goes first.
        if self.graph is not None:
            self.graph.release()
        self.graph = None
        gc.collect()
        self.engine.transport.close()
        if not dist.is_initialized():
            return True
        done = threading.Event()

        def destroy() -> None:
            dist.destroy_process_group()
            done.set()

        threading.Thread(target=destroy, daemon=True, name="peerline-teardown").start()
        if not done.wait(timeout_s):
            log.warning("process group teardown did not finish in %.0f s; exiting without it", timeout_s)
            return False
        return True

    def layer_checksums(self) -> dict[str, list[float]]:
        """{global layer index: [sum, sum of squares] of its parameters in float64}, from every replica's ranks,
        gathered to all ranks: equal checksums across replicas show the replicas stayed in step, and equal
        checksums against a single-process run show the same final parameters."""
        mine: dict[str, list[float]] = {}
        with use(self.engine.main_stream):  # after the optimizer steps queued there
            for sid, stage in self.engine.stages.items():
                for i, layer in enumerate(stage.module):
                    params = [p.detach().double() for p in layer.parameters()]
                    key = f"r{self.mesh.replica}/{self.layer_offsets[sid] + i}"
                    mine[key] = [sum(float(p.sum()) for p in params), sum(float((p * p).sum()) for p in params)]
        if dist.is_initialized() and self.info.world_size > 1:
            everyone: list[dict[str, list[float]] | None] = [None] * self.info.world_size
            dist.all_gather_object(everyone, mine)
            for d in everyone:
                mine.update(d)
        return mine

    def write_timeline(self, path_stem: str) -> None:
        """Gather the last iteration's spans to rank 0 on one clock, draw them (PNG + Chrome trace), and warn
        about any span that starts before its dependency ended."""
        gathered = self.engine.timeline.gather()  # collective; None except on rank 0
        if gathered is None:
            return
        from peerline.distributed.observe.timeline_check import check_spans
        from peerline.distributed.observe.timeline_draw import write_timeline

        for path in write_timeline(gathered, path_stem):
            print(f"peerline: timeline written to {path}", flush=True)
        for problem in check_spans(gathered, pp=self.mesh.pp, stages_per_rank=self.cfg.stages)[:5]:
            log.warning("timeline: %s", problem)
