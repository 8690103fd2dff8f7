"""The Runtime: one rank's training loop, the reads around it (loss, checksums) and its teardown.

    rt = Runtime.create(cfg, hooks=[Failsafe.attach])   # assemble.py builds the parts; each factory gets the rt
    losses = rt.train(on_iteration=...)                  # the loop below
    rt.close()

One launch of the loop (hooks.py says when each hook runs):

    graphs.plan(...)                    capture once warm (every rank together); the launch's size: 1, or K looped
    hooks.before_launch(first, n)       e.g. the failsafe: watchdog deadline, injected faults, non-finite counter
    feed.load + engine.iteration()      eager; or graph.load + replay; or one launch of the looped graph
    hooks.after_launch(last)            e.g. the failsafe: a checkpoint at --save-every
    on a logged launch (--log-every): the loss read (one host sync), hooks.on_logged(stats), on_iteration(stats)
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from peerline.distributed.assemble import RunParts, assemble
from peerline.distributed.config import RunConfig
from peerline.distributed.cudagraph.capture import IterationGraph
from peerline.distributed.env import LaunchInfo
from peerline.distributed.grad_sync.sharded_adamw import optimizer_state_bytes
from peerline.distributed.hooks import IterationHooks, IterationStats
from peerline.distributed.memory.state_bytes import per_rank, state_bytes
from peerline.distributed.streams import use
from peerline.kernels.capture_state import eager_only
from peerline.models.flops import peak_bf16_tflops

log = logging.getLogger(__name__)

__all__ = ["Runtime", "IterationStats", "HookFactory"]

#: Makes a hook for a built runtime (e.g. `Failsafe.attach`: checks, resumes and starts its watchdog).
HookFactory = Callable[["Runtime"], IterationHooks]


class Runtime:
    """Everything one rank needs to train, built once (assemble.py), and the loop that trains it."""

    def __init__(self, parts: RunParts) -> None:
        self.cfg = parts.cfg
        self.info, self.device, self.mesh = parts.grid.info, parts.grid.device, parts.grid.mesh
        self.programs = parts.grid.programs
        self.engine, self.streams, self.links = parts.engine, parts.streams, parts.links
        self.split, self.layer_offsets = parts.split, parts.layer_offsets
        self.workload = parts.workload  # the model, its data and vocabulary (the start line)
        self.transport_name = parts.engine.transport.describe()
        self.graphs = parts.graphs  # the CUDA-graph policy and state (cudagraph/policy.py)
        self.hooks: list[IterationHooks] = list(parts.hooks)
        self.run_notices = list(parts.notices)
        self.flops_per_token = parts.flops_per_token  # model FLOPs of one trained token (None: unknown)
        # The bf16 peak of one card (None: the CPU or a card not in models/flops.py): MFU's denominator.
        self.peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name(self.device)) \
            if self.device.type == "cuda" else None
        self.iteration = 0  # iterations completed since the start of training (a resumed run starts later)
        self.iterations_run = 0  # iterations this process ran: a resumed run warms up again before capture
        self.stop_reason: str | None = None  # set by a hook (every rank alike) to end training at this boundary

    @classmethod
    def create(cls, cfg: RunConfig, info: LaunchInfo | None = None, hooks: Sequence[HookFactory] = ()) -> Runtime:
        """Assemble the run, then make each hook from the built runtime (a failing factory closes it again)."""
        rt = cls(assemble(cfg, info))
        try:
            for make in hooks:
                rt.hooks.append(make(rt))
        except BaseException:
            rt.close()
            raise
        return rt

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def tokens_per_iteration(self) -> int:
        c = self.cfg
        return c.micro_batch_size * c.seq * c.microbatches * c.dp

    @property
    def graph(self) -> IterationGraph | None:
        """The captured iteration, once there is one."""
        return self.graphs.graph

    @property
    def graph_failed(self) -> str | None:
        """Why the iteration runs eager although graphs were wanted (capture failed or was refused)."""
        return self.graphs.failed

    @property
    def graph_loop_failed(self) -> str | None:
        """Why a captured graph replays one iteration per launch although --graph-loop K asked for a loop."""
        return self.graphs.loop_failed

    @property
    def graph_loop(self) -> int:
        """Iterations one host launch runs now: K once the looped graph is built (--graph-loop K), else 1."""
        return self.graphs.loop_iterations

    @property
    def notices(self) -> list[str]:
        """One-line notices for the start of the run (flags a user model ignores, options ignored here, graphs
        turned off)."""
        return [*self.run_notices, *self.graphs.notices]

    # -- training ----------------------------------------------------------------------------------------------
    def train(self, iters: int | None = None, on_iteration: Callable[[IterationStats], None] | None = None
              ) -> list[float]:
        """Run up to `iters` iterations counted from the start of training (default --iters); return the losses
        of the logged ones."""
        target = self.cfg.iters if iters is None else iters
        losses = []
        try:
            for hook in self.hooks:
                hook.on_train_start(self)
            while self.iteration < target and self.stop_reason is None:
                stats = self._launch_and_log(target)
                if stats is None:
                    continue
                losses.append(stats.loss)
                for hook in self.hooks:
                    hook.on_logged(self, stats)
                if on_iteration is not None:
                    on_iteration(stats)
            self.engine.finish_parameter_gathers()  # the last step's overlapped all-gathers, before anyone reads
            for hook in reversed(self.hooks):
                hook.on_train_end(self)
        except BaseException as exc:
            for hook in reversed(self.hooks):
                hook.on_error(self, exc)
            raise
        return losses

    def request_stop(self, reason: str) -> None:
        """End training after the current launch, as if the target were reached (`on_train_end` runs: a final
        checkpoint is written). Every rank must ask at the same boundary (e.g. resilience/preemption.py agrees)."""
        self.stop_reason = reason

    def run_iteration(self, eager: bool = False) -> None:
        """One launch of one iteration: captured first when due, then a graph replay once there is a graph, unless
        `eager` (a timeline is recorded from an eager iteration: timing events stay out of graphs)."""
        self.graphs.maybe_capture(self.engine, self.iterations_run)
        self._launch(1, eager)

    def run_looped(self) -> int:
        """One launch of the looped graph: K iterations (only once `graph_loop` > 1); returns K."""
        k = self.graph_loop
        if k <= 1:
            raise RuntimeError("run_looped needs a built graph loop (--graph-loop K > 1 on a GPU, after capture)")
        self._launch(k, eager=False)
        return k

    def _launch_and_log(self, target: int) -> IterationStats | None:
        """Plan, time and run the next launch; on a logged one, read the loss and return the stats."""
        launch = self.graphs.plan(self.engine, self.iteration, self.iterations_run, target, self._launch_stops())
        log_now = (self.iteration + launch.n) % self.cfg.log_every == 0 or self.iteration + launch.n == target
        watch = _Stopwatch(self.engine.main_stream)
        self._launch(launch.n, launch.eager)
        if not log_now:
            return None
        ms = watch.elapsed_ms() / launch.n
        return self.measure(self.read_loss(), ms)

    def measure(self, loss: float, ms: float) -> IterationStats:
        """The stats of a logged iteration: throughput, model TFLOP/s and MFU, every rank's peak memory (one small
        all-gather on a GPU: a logged iteration has synchronized already)."""
        tokens_per_s = self.tokens_per_iteration / (ms / 1e3)
        per_rank = self.peak_memory_per_rank()
        tflops = self.flops_per_token * tokens_per_s / 1e12 if self.flops_per_token else None
        mfu = 100 * tflops / (self.peak_tflops * self.info.world_size) if tflops and self.peak_tflops else None
        ppl = math.exp(min(loss, 700.0)) if self.cfg.loss == "cross-entropy" and math.isfinite(loss) else None
        return IterationStats(self.iteration, loss, ms, tokens_per_s, max(per_rank) if per_rank else 0.0,
                              ppl=ppl, tflops=tflops, mfu=mfu, peak_mem_gb_per_rank=per_rank)

    def peak_memory_per_rank(self) -> list[float] | None:
        """Every rank's peak allocated device memory so far, GiB, by rank (collective); None on the CPU."""
        if self.device.type != "cuda":
            return None
        with use(self.engine.main_stream):
            mine = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], device=self.device)
            if not (dist.is_initialized() and self.info.world_size > 1):
                return mine.tolist()
            everyone = torch.empty(self.info.world_size, device=self.device)
            dist.all_gather_into_tensor(everyone, mine)
            return everyone.tolist()

    def _launch_stops(self) -> tuple[int, ...]:
        """Cadences at which a launch must end: the loss read, and whatever the hooks ask for."""
        return (self.cfg.log_every, *[every for hook in self.hooks for every in hook.launch_stops])

    def _launch(self, n: int, eager: bool) -> None:
        """Issue iterations iteration+1 .. iteration+n in one launch, between the hooks' before/after_launch."""
        for hook in self.hooks:
            hook.before_launch(self, self.iteration + 1, n)
        with use(self.engine.main_stream):
            graph = self.graphs.graph
            if n > 1:
                graph.run_loop(self.iteration)
            elif graph is not None and not eager:
                graph.load(self.iteration)
                graph.replay()
            else:
                self.engine.feed.load(self.iteration)
                with eager_only():  # nothing captures here: the kernels skip the driver's capture query
                    self.engine.iteration()
        self.iteration += n
        self.iterations_run += n
        for hook in reversed(self.hooks):
            hook.after_launch(self, self.iteration)

    # -- reads and teardown ------------------------------------------------------------------------------------
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

    def close(self, timeout_s: float = 20.0) -> bool:
        """Free the transport and end the process group. Returns False when the NCCL teardown did not finish in
        `timeout_s` (the caller then exits hard rather than hang)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # A captured graph holds references to the NCCL communicators it captured; ncclCommDestroy waits for
            # them (pytorch/pytorch#115388), so the graphs go first, and their reference cycles with them (a full
            # collection costs about a second of CPU over torch's heap: only where graphs exist).
            self.graphs.release()
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
        self.engine.finish_parameter_gathers()  # collective: every rank reads its checksums here
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


    def state_bytes_per_rank(self) -> dict[str, list[int]]:
        """Every rank's parameters, gradients and optimizer state in bytes (memory/state_bytes.py), by kind and
        rank (collective: a small all-gather of Python objects)."""
        params = [p for stage in self.engine.stages.values() for p in stage.module.parameters()]
        return per_rank(state_bytes(params, self.engine.optimizer))

    def optimizer_state_bytes_per_rank(self) -> list[int]:
        """Every rank's optimizer state in bytes (AdamW's moments and steps; about 1/dp with --shard-optimizer),
        by rank (collective: a small all-gather of Python objects)."""
        mine = optimizer_state_bytes(self.engine.optimizer)
        if not (dist.is_initialized() and self.info.world_size > 1):
            return [mine]
        everyone: list[int | None] = [None] * self.info.world_size
        dist.all_gather_object(everyone, mine)
        return [int(v or 0) for v in everyone]


class _Stopwatch:
    """Times one launch: CUDA events on the main stream on a GPU (started when made), the host clock on the CPU."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        self.t0 = time.perf_counter()
        if stream is not None:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record(stream)

    def elapsed_ms(self) -> float:
        """Milliseconds since the start (on a GPU: waits for the launch's work on the stream to finish)."""
        if self.stream is None:
            return (time.perf_counter() - self.t0) * 1e3
        self.end.record(self.stream)
        self.end.synchronize()
        return self.start.elapsed_time(self.end)
