"""Executes one rank's share of a pipeline schedule: one training iteration at a time.

The engine owns the iteration: it issues every forward, backward, handoff, gradient sync and the optimizer step
in schedule order, on the stages' compute streams, and never waits on the host. That makes `iteration()` safe to
capture into a CUDA graph (cudagraph/capture.py). The loss is accumulated on the device into `loss_sum`; reading
it is the caller's business, once per logged iteration.

A rank runs one stage (one process per GPU) or several (single-GPU mode: stages as streams of one device).
Handoffs to a stage of another rank go through the `Transport`; handoffs between local stages are an
event (stream wait) on the same device, no copy.

What a stage hands on is a tensor or a tuple / list / dict of tensors (boundary.py): the next stage's module
receives it as its one argument. Several tensors travel as one packed message each way (the gradient message
holds the floating leaves' gradients only); a single tensor takes the plain path, unpacked. The first stage's
input is the feed's one buffer; the last stage's output goes to `loss_fn` as it is, structure and all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.distributed.config import ConfigError
from peerline.distributed.data import counter as counter_data
from peerline.distributed.model import fill_batch
from peerline.distributed.observe.timeline import Timeline
from peerline.distributed.p2p.base import ACT, GRAD, TensorSpec, Transport
from peerline.distributed.pipeline import boundary, split_backward
from peerline.distributed.pipeline.boundary import BoundarySpec
from peerline.distributed.pipeline.schedule import Step, step_str
from peerline.distributed.streams import use, wait_stream
from peerline.kernels import fused_linear


class GradSync(Protocol):
    def zero_grad(self) -> None: ...
    def arm(self) -> None: ...
    def finish(self) -> None: ...
    def metrics(self) -> dict[str, float]: ...


#: What a transferred message is in the pipeline, whatever transport channel and id carry it: (kind ACT / GRAD,
#: boundary b between stages b and b+1, microbatch).
MessageLabel = tuple[str, int, int]


class ExchangeObserver(Protocol):
    """Told of every exchange with another rank, on the host, around `Transport.exchange` (e.g. the watchdog's
    view of which edge and microbatch this rank waits for). Both run on the exchanging stage's stream.
    `send_labels` / `recv_labels` say what each send / receive carries (placed schedules route messages over
    other channels and ids than their kind and microbatch)."""

    def on_exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]],
                    send_labels: list[MessageLabel], recv_labels: list[MessageLabel]) -> None: ...
    def after_exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]],
                       received: list[torch.Tensor]) -> None: ...


@dataclass
class LocalStage:
    """One pipeline stage held by this rank, with its per-iteration state."""

    index: int  # global stage index
    n_stages: int
    module: nn.Module
    stream: torch.cuda.Stream | None
    out_spec: BoundarySpec  # what this stage hands on (a TensorSpec is taken as a single tensor)
    grad_sync: GradSync | None = None
    in_spec: BoundarySpec | None = None  # what it receives from the stage before (None: a single tensor)
    inputs: dict[int, Any] = field(default_factory=dict)  # received boundary values (tensor or structure)
    outputs: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    grads_in: dict[int, torch.Tensor | list[torch.Tensor]] = field(default_factory=dict)  # list: per float leaf
    pending_w: dict[int, split_backward.Pending] = field(default_factory=dict)  # B done, W not yet (split)

    def __post_init__(self) -> None:
        if isinstance(self.out_spec, TensorSpec):
            self.out_spec = BoundarySpec.of_tensor(self.out_spec)
        if isinstance(self.in_spec, TensorSpec):
            self.in_spec = BoundarySpec.of_tensor(self.in_spec)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        self.losses.clear()
        self.grads_in.clear()
        self.pending_w.clear()


@dataclass
class DataFeed:
    """Static input / target buffers of every microbatch, refilled in place before each iteration (so a captured
    graph reads fresh data from the same addresses). Replica r's microbatch m is global microbatch r*M+m."""

    seed: int
    replica: int
    microbatches: int
    inputs: list[torch.Tensor]  # empty unless this rank holds the first stage
    targets: list[torch.Tensor]  # empty unless this rank holds the last stage
    generator: torch.Generator

    def load(self, iteration: int) -> None:
        self.load_into(iteration, self.inputs, self.targets)

    def load_into(self, iteration: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Fill `inputs` / `targets` (shaped like this feed's buffers) with the data of `iteration`: the static
        buffers themselves (load), or a slot of a device-side ring that a looped graph copies from
        (cudagraph/loop.py)."""
        for buf, global_mb, stream_id in self.buffers(inputs, targets):
            fill_batch(buf, self.seed, iteration, global_mb, stream_id, self.generator)

    def buffers(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]
                ) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(buffer, global microbatch, stream) of every input (stream 0) and target (stream 1): replica r's
        microbatch m is global microbatch r*M+m, so every replica draws its own data."""
        for stream_id, bufs in ((0, inputs), (1, targets)):
            for mb, buf in enumerate(bufs):
                yield buf, self.replica * self.microbatches + mb, stream_id


@dataclass
class CounterDataFeed(DataFeed):
    """`--data counter`: the same static buffers, filled from a counter-based hash (data/counter.py) of the
    iteration held on the device in `counter`. A captured iteration makes its own data (`generate`, then
    `advance`), so replays need no host work for data; eager iterations set the counter and generate (`load`).
    `counter_at` is the host's view of the value the counter holds when the work queued so far has run."""

    counter: torch.Tensor | None = None  # int64, one element, on the buffers' device
    counter_at: int | None = None

    def load(self, iteration: int) -> None:
        self.set_iteration(iteration)
        self.generate()

    def load_into(self, iteration: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        raise NotImplementedError("counter data is generated in place from the device counter: use load()")

    def set_iteration(self, iteration: int) -> None:
        """Point the counter at `iteration` (one tiny fill on the current stream, skipped when it is there)."""
        if self.counter_at != iteration:
            self.counter.fill_(iteration)
            self.counter_at = iteration

    def generate(self) -> None:
        """Fill every buffer with the data of the counter's iteration (capturable)."""
        for buf, global_mb, stream_id in self.buffers(self.inputs, self.targets):
            counter_data.fill(buf, self.seed, self.counter, global_mb, stream_id)

    def advance(self) -> None:
        """counter += 1 on the device (captured after generate, so every replay makes the next iteration's data)."""
        self.counter.add_(1)

    def advanced(self, iterations: int) -> None:
        """The host's view after launching `iterations` replays of a graph that captured `advance`."""
        self.counter_at += iterations


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Route = Callable[[str, int, int], tuple[str, int]]


def direct_route(kind: str, boundary: int, mb: int) -> tuple[str, int]:
    """One stage per rank: a message travels on its own kind's channel, named by its microbatch."""
    return kind, mb


_NO_SPAN = contextlib.nullcontext()  # reentrant and reusable: the span of every action when no timeline records
_NO_AUTOCAST = contextlib.nullcontext()  # the same, for the autocast regions of a run without autocast


def no_range_push(name: str) -> None:
    """The range marks when nobody profiles: one call that does nothing (NVTX off)."""


def no_range_pop() -> None:
    """See `no_range_push`."""


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The default model's loss: mean squared error in fp32 against the target buffer."""
    return F.mse_loss(output.float(), target)


class Engine:
    """Runs `program` (a global order of (stage, step) over this rank's stages) once per `iteration()`.
    `loss_fn(last stage's output, target)` gives one microbatch's mean loss (run outside autocast)."""

    def __init__(self, *, stages: list[LocalStage], program: list[tuple[int, Step]], transport: Transport,
                 optimizer: torch.optim.Optimizer, feed: DataFeed, microbatches: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, timeline: Timeline | None = None,
                 check_shapes: bool = True, loss_fn: LossFn = mse_loss, route: Route | None = None) -> None:
        self.stages = {s.index: s for s in stages}
        #: (kind, boundary, mb) of a message to another rank -> the transport's (channel, id); by default the kind
        #: and the microbatch (one stage per rank); pipeline/placement.py where a rank holds several stages
        self._route = route or direct_route
        self.order = [s.index for s in stages]
        self.program = program
        self.transport = transport
        self.optimizer = optimizer
        self.feed = feed
        self.m = microbatches
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.timeline = timeline or Timeline(rank=0, enabled=False)
        self.check_shapes = check_shapes
        self.loss_fn = loss_fn
        #: called on the main stream after every gradient is final and before the optimizer step (e.g. summing
        #: tied weights' gradients across stages); capturable work only
        self.before_step: list[Callable[[], None]] = []
        #: called on the main stream first in every iteration, before any forward (--overlap-param-gather's
        #: all-gathers of the parameters the last step updated, grad_sync/param_gather.py); capturable work only
        self.at_iteration_start: list[Callable[[], None]] = []
        #: called by `finish_parameter_gathers()`: what makes the parameters whole between iterations
        self.parameter_barriers: list[Callable[[], None]] = []
        #: told of every exchange with another rank (None: nobody watches); set before any capture
        self.exchange_observer: ExchangeObserver | None = None
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        #: marks a named range around every step of the program and the optimizer step, on the host (NVTX for
        #: Nsight Systems, profiler labels: observe/profiler.py); no-ops unless `set_ranges` turned them on
        self.range_push: Callable[[str], None] = no_range_push
        self.range_pop: Callable[[], None] = no_range_pop
        self._range_names = [f"stage{s} {step_str(step)}" for s, step in program]
        for s in self.order:  # a stage after a local one receives what that one hands on
            if s - 1 in self.stages:
                self.stages[s].in_spec = self.stages[s - 1].out_spec
        # The step after which each stage's gradients are final (the last B, or the last W where the backward is
        # split): arm the gradient sync just before it.
        self._last_backward = {}
        self._split = {s for s, step in program if step[0].op == "W"}
        for pos, (s, step) in enumerate(program):
            if step[0].op in ("B", "W"):
                self._last_backward[s] = pos
        self._params = {s: [p for p in self.stages[s].module.parameters() if p.requires_grad] for s in self.order}
        # Host cost per step, hoisted here: consecutive steps of one stage form a run whose compute stream is entered
        # once (one stage per rank: once per iteration), and the non-forward steps' autocast-off region is one
        # object made once (fused_linear.AutocastOff), not a torch.autocast built and checked per step.
        self._runs: list[tuple[LocalStage, list[tuple[int, Step]]]] = []
        for pos, (s, step) in enumerate(program):
            if not self._runs or self._runs[-1][0].index != s:
                self._runs.append((self.stages[s], []))
            self._runs[-1][1].append((pos, step))
        self._no_autocast = (contextlib.nullcontext() if autocast_dtype is None
                             else fused_linear.autocast_off(device.type))

    def set_ranges(self, push: Callable[[str], None], pop: Callable[[], None]) -> None:
        """Mark every step with `push(name)` before and `pop()` after it (host calls: eager iterations only)."""
        self.range_push, self.range_pop = push, pop

    def use_feed(self, feed: DataFeed) -> None:
        """Read the data from `feed` from the next iteration on (a feed with the same static buffers, such as the
        pinned staging feed, keeps a captured graph valid)."""
        self.feed = feed

    # -- streams -------------------------------------------------------------------------------------------
    @property
    def main_stream(self) -> torch.cuda.Stream | None:
        """The stream an iteration forks from and joins into (the first local stage's compute stream)."""
        return self.stages[self.order[0]].stream

    def _autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return _NO_AUTOCAST
        if not enabled:
            return self._no_autocast
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _span(self, lane: str, label: str, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """The timeline's span of an action, or one shared no-op context when the timeline records nothing."""
        return self.timeline.span(lane, label, stream) if self.timeline.enabled else _NO_SPAN

    def _compute_span(self, stage: LocalStage, op: str, mb: int) -> contextlib.AbstractContextManager:
        """The span of compute action `op` of microbatch `mb` on the stage's lane; its lane and label are made
        only when the timeline records (every forward and backward asks)."""
        if not self.timeline.enabled:
            return _NO_SPAN
        return self.timeline.span(self._lane(stage.index), f"{op}{mb}", stage.stream)

    # -- one iteration -------------------------------------------------------------------------------------
    def iteration(self) -> None:
        """Issue one whole training iteration. No host synchronization on GPUs."""
        main = self.main_stream
        self.timeline.start_iteration(main)
        fused_linear.new_iteration()  # weights changed since the last iteration: recast them once (fused_linear.py)
        with use(main):
            self.loss_sum.zero_()
            for fn in self.at_iteration_start:
                fn()
        for s in self.order:  # fork: every stage stream starts after the data load and the last step
            stage = self.stages[s]
            wait_stream(stage.stream, main)
            with use(stage.stream):
                stage.grad_sync.zero_grad()
        # One autocast region over the whole schedule: autocast caches each weight's low-precision copy until
        # its outermost region ends, so the weights are cast once per iteration instead of once per microbatch
        # (the weights only change in the optimizer step, after the region). Non-forward steps run in a nested
        # disabled region, which keeps the cache.
        push, pop, names, run_step = self.range_push, self.range_pop, self._range_names, self._step
        marked = push is not no_range_push or pop is not no_range_pop  # else the marks are not called at all
        with self._autocast():
            for stage, steps in self._runs:
                with use(stage.stream):
                    for pos, step in steps:
                        if marked:
                            push(names[pos])
                        run_step(stage, pos, step)
                        if marked:
                            pop()
        for s in self.order:
            stage = self.stages[s]
            with use(stage.stream):
                stage.grad_sync.finish()
            wait_stream(main, stage.stream)  # join
        with use(main):
            self.transport.finish_iteration()
            for fn in self.before_step:
                fn()
            self.range_push("optimizer")
            with self._span(self._lane(self.order[0]), "optimizer", main):
                self.optimizer.step()
            self.range_pop()
        for stage in self.stages.values():
            stage.clear()

    def finish_parameter_gathers(self) -> None:
        """Make every parameter whole before something reads it between iterations (checksums, checkpoints, the end
        of training): with --overlap-param-gather the last step's all-gathers otherwise wait for the next
        iteration's start. Collective over the dp group (every rank calls it at the same point); on a GPU the host
        waits for the main stream (readers on other threads or streams see the result). Nothing without barriers."""
        if not self.parameter_barriers:
            return
        main = self.main_stream
        with use(main):
            for fn in self.parameter_barriers:
                fn()
        if main is not None:
            main.synchronize()

    def _step(self, stage: LocalStage, pos: int, step: Step) -> None:
        """Program step `pos` of `stage`, on its stream, inside the iteration's autocast region."""
        op = step[0].op
        if op == "F":
            self._forward(stage, step[0].mb)
            return
        with self._no_autocast:
            if op in ("B", "W"):
                if self._last_backward[stage.index] == pos:
                    stage.grad_sync.arm()
                if op == "W":
                    self._weight(stage, step[0].mb)
                else:
                    self._backward(stage, step[0].mb)
            else:
                self._communicate(stage, step)

    def _lane(self, s: int) -> str:
        return "compute" if len(self.order) == 1 else f"compute{s}"

    def _forward(self, stage: LocalStage, mb: int) -> None:
        x = self.feed.inputs[mb] if stage.is_first else stage.inputs[mb]
        with self._compute_span(stage, "F", mb):
            out = stage.module(x)  # inside iteration()'s autocast region
        if self.check_shapes:
            self._check_output(stage, mb, out)
        stage.outputs[mb] = out
        if stage.is_last:
            # Mean over the replica's microbatches: the 1/M scale makes the summed gradients a mean.
            with self._autocast(enabled=False):
                loss = self.loss_fn(out, self.feed.targets[mb]) / self.m
            stage.losses[mb] = loss
            self.loss_sum.add_(loss.detach())

    @staticmethod
    def _check_output(stage: LocalStage, mb: int, out: Any) -> None:
        """The output must keep the first microbatch's structure, shapes and dtypes (the transport's buffers and
        a captured graph are sized by them)."""
        spec = stage.out_spec
        if spec.is_tensor and isinstance(out, torch.Tensor):
            if out.shape == spec.shape and out.dtype == spec.dtype:  # torch.Size compares with a tuple
                return
            raise ConfigError(f"stage {stage.index} output changed between microbatches: microbatch {mb} gave "
                              f"{tuple(out.shape)} {out.dtype}, the first gave {spec.shape} {spec.dtype}")
        problem = spec.mismatch(out)
        if problem is not None:
            raise ConfigError(f"stage {stage.index} output changed between microbatches: microbatch {mb} gave "
                              f"{problem} (the first gave {spec.describe()})")

    def _backward(self, stage: LocalStage, mb: int) -> None:
        with self._compute_span(stage, "B", mb):
            if stage.index in self._split:
                self._backward_input(stage, mb)
            elif stage.is_last:
                stage.losses.pop(mb).backward()
            elif stage.out_spec.is_tensor:
                torch.autograd.backward(stage.outputs[mb], grad_tensors=stage.grads_in[mb])
            else:
                boundary.backward(stage.outputs[mb], stage.grads_in[mb], stage.out_spec)
        stage.outputs.pop(mb, None)
        if stage.index not in self._split:  # else W still reads them
            stage.grads_in.pop(mb, None)
            self._release(stage, mb)

    def _backward_input(self, stage: LocalStage, mb: int) -> None:
        """B of a split backward: the input gradient now, the weight gradients left for W (split_backward.py)."""
        if stage.is_last:
            outs, grads = [stage.losses.pop(mb)], [None]
        elif stage.out_spec.is_tensor:
            outs, grads = [stage.outputs[mb]], [stage.grads_in[mb]]
        else:
            leaves = boundary.flatten(stage.outputs[mb])
            outs = [leaves[i] for i in stage.out_spec.float_index]
            grads = list(stage.grads_in[mb])
        x = None if stage.is_first else stage.inputs.get(mb)
        inputs = [] if x is None else ([x] if isinstance(x, torch.Tensor) else boundary.flatten(x))
        stage.pending_w[mb] = split_backward.backward_input(outs, grads, inputs, self._params[stage.index])

    def _weight(self, stage: LocalStage, mb: int) -> None:
        """W of a split backward: the weight gradients B left; then the received slots are free."""
        with self._compute_span(stage, "W", mb):
            split_backward.backward_weight(stage.pending_w.pop(mb), self._params[stage.index])
        stage.grads_in.pop(mb, None)
        self._release(stage, mb)

    def _release(self, stage: LocalStage, mb: int) -> None:
        """This stage no longer reads what it received for mb: a remote sender may reuse those slots."""
        if not stage.is_first and stage.index - 1 not in self.stages:
            self.transport.release(*self._route(ACT, stage.index - 1, mb))
        if not stage.is_last and stage.index + 1 not in self.stages:
            self.transport.release(*self._route(GRAD, stage.index, mb))

    def _communicate(self, stage: LocalStage, step: Step) -> None:
        sends: list[tuple[str, int, torch.Tensor]] = []
        recvs: list[tuple[str, int]] = []
        takers: list[tuple[LocalStage, str, int]] = []  # who takes each receive
        send_labels: list[MessageLabel] = []
        recv_labels: list[MessageLabel] = []
        for a in step:
            own = stage if a.stage < 0 else self.stages[a.stage]  # a rank's group may hold several stages' actions
            kind = ACT if a.op in ("SA", "RA") else GRAD
            forward = a.op in ("SA", "RG")
            peer = own.index + (1 if forward else -1)
            if peer in self.stages:
                if a.op in ("RA", "RG"):
                    self._receive_local(own, self.stages[peer], kind, a.mb)
                continue  # a local send is the producer's work already queued on its stream
            label = (kind, own.index if forward else own.index - 1, a.mb)
            channel, ident = self._route(*label)
            if a.op == "SA":
                sends.append((channel, ident, self._act_message(own, a.mb)))
            elif a.op == "SG":
                sends.append((channel, ident, self._grad_message(own, a.mb)))
            else:
                recvs.append((channel, ident))
                takers.append((own, kind, a.mb))
            (recv_labels if a.op in ("RA", "RG") else send_labels).append(label)
        if not sends and not recvs:
            return
        observer = self.exchange_observer
        with self._span("p2p", step_str(step) if self.timeline.enabled else "", stage.stream):
            if observer is not None:
                observer.on_exchange(sends, recvs, send_labels, recv_labels)
            received = self.transport.exchange(sends, recvs)
            if observer is not None:
                observer.after_exchange(sends, recvs, received)
        for (own, kind, mb), tensor in zip(takers, received):
            self._accept(own, kind, mb, tensor)

    @staticmethod
    def _act_message(stage: LocalStage, mb: int) -> torch.Tensor:
        """The output of mb as one message: the tensor itself, or a structure's leaves packed."""
        out = stage.outputs[mb]
        return out.detach() if stage.out_spec.is_tensor else boundary.act_message(out)

    @staticmethod
    def _grad_message(stage: LocalStage, mb: int) -> torch.Tensor:
        """The input gradient of mb as one message: the input's .grad, or its floating leaves' gradients packed."""
        x = stage.inputs.pop(mb)
        if stage.in_spec is None or stage.in_spec.is_tensor:
            return x.grad
        return boundary.grad_message(boundary.input_grads(x, stage.in_spec))

    def _receive_local(self, stage: LocalStage, producer: LocalStage, kind: str, mb: int) -> None:
        """Same-device handoff: order this stage's stream after the producer's queued work; no copy (a structure
        passes by reference, leaf by leaf)."""
        wait_stream(stage.stream, producer.stream)
        spec = producer.out_spec if kind == ACT else stage.out_spec  # the boundary between the two
        if kind == ACT:
            value = producer.outputs[mb]
            value = value.detach() if spec.is_tensor else boundary.as_input(boundary.flatten(value), spec)
        elif spec.is_tensor:
            value = producer.inputs.pop(mb).grad
        else:
            value = boundary.input_grads(producer.inputs.pop(mb), spec)
        if stage.stream is not None:  # the allocator must not reuse them while this stream reads them
            for tensor in [value] if isinstance(value, torch.Tensor) else boundary.flatten(value):
                tensor.record_stream(stage.stream)
        if kind == ACT and spec.is_tensor:
            value = value.requires_grad_(True)
        if kind == ACT:
            stage.inputs[mb] = value
        else:
            stage.grads_in[mb] = value

    @staticmethod
    def _accept(stage: LocalStage, kind: str, mb: int, tensor: torch.Tensor) -> None:
        """Take a message received from another rank: the next stage's input, or the gradient of this stage's
        output (unpacked into views of the message where it holds several tensors)."""
        if kind == ACT:
            spec = stage.in_spec
            if spec is None or spec.is_tensor:
                stage.inputs[mb] = tensor.detach().requires_grad_(True)
            else:
                stage.inputs[mb] = boundary.received_input(tensor, spec)
        elif stage.out_spec.is_tensor:
            stage.grads_in[mb] = tensor
        else:
            stage.grads_in[mb] = boundary.received_grads(tensor, stage.out_spec)
