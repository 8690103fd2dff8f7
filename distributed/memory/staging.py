"""Input staging from pinned host memory and results back: the three-way overlap of single-GPU mode.

`PinnedStagingFeed` has the interface of engine.DataFeed (`load(iteration)`, `.inputs`, `.targets`: static device
buffers, one per microbatch) and moves the data like this:

    host fill -> pinned slot (ring of K) --h2d stream--> landing buffer --main stream--> static input buffer
    static result buffer (written by a forward hook of the last stage) --main--> outbox --d2h stream--> pinned slot

Why the landing and outbox buffers: the static buffers are read by the running iteration (and, for a captured
CUDA graph, by fixed address). Copying the next iteration's data straight into them would have to wait until the
current iteration is done with them, which serializes the copies with compute. A second device buffer lets the
H2D of iteration i+1 run while iteration i computes, and the D2H of iteration i's results run while iteration i+1
computes; the device-to-device hop costs a few percent of the host copy (HBM is ~50x faster than PCIe/C2C).
Everything here happens in `load()`, outside the iteration, so a captured iteration is unaffected: it reads the
same static buffers at the same addresses, and the result hook's copies are plain device copies inside it.

Every copy on the compute side is issued on the engine's main stream (`main_stream`, which the runtime and
`attach` pass; else the stream current at `load()`), also from `flush()`/`drain()`, which a caller runs outside
the iteration, where the current stream is the legacy default stream: that stream does not wait for our
non-blocking streams, so results copied there would read the result buffers while the last iteration still runs
(the last iteration's losses would come back stale).

Cross-stream order is events only. A pinned slot is refilled only after the copy that read it has finished: the
host queries that copy's event and waits on that one event only when the ring comes round to a slot still in
flight (never a device-wide sync). The host runs ahead of the GPU by about one iteration (the caller must not sync
every iteration for the overlap to show; Runtime.train syncs only on logged iterations).

On the CPU (no streams) the same code copies synchronously, and the data equals DataFeed's exactly: both fill
with `model.fill_batch` from a CPU generator.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.distributed.model import fill_batch
from peerline.distributed.streams import RankStreams, use

log = logging.getLogger(__name__)

T = TypeVar("T")
RESULTS = ("none", "losses", "outputs")


class Fence(Protocol):
    """What the ring needs of a CUDA event: `query()` (done yet?, no wait) and `synchronize()` (wait for it)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class HostSlotRing(Generic[T]):
    """K host slots used round robin. A slot handed out again first waits for the fence of its last copy.

    `waits` counts the times the host had to wait (the ring was full with copies in flight); `acquired` counts
    hand-outs. The fence is any object with query()/synchronize() (a CUDA event; a fake in the unit tests).
    """

    def __init__(self, slots: list[T]) -> None:
        if not slots:
            raise ValueError("a slot ring needs at least one slot")
        self.slots = slots
        self.fences: list[Fence | None] = [None] * len(slots)
        self.next = 0
        self.waits = 0
        self.acquired = 0

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self) -> tuple[int, T]:
        """The next slot, once the copy that last read (or wrote) it has finished."""
        i = self.next
        self.next = (i + 1) % len(self.slots)
        fence = self.fences[i]
        if fence is not None and not fence.query():
            self.waits += 1
            fence.synchronize()  # this one copy's event, never the device
        self.fences[i] = None
        self.acquired += 1
        return i, self.slots[i]

    def release(self, i: int, fence: Fence | None) -> None:
        """Slot i is in use by a copy that completes with `fence` (None: free now)."""
        self.fences[i] = fence

    def in_flight(self) -> int:
        return sum(f is not None and not f.query() for f in self.fences)


@dataclass
class Result:
    """What came back for one iteration: per-microbatch losses (MSE of each microbatch, not divided by M) and,
    when asked for, the last stage's outputs (M, *shape) on the host."""

    iteration: int
    losses: torch.Tensor
    outputs: torch.Tensor | None = None


@dataclass
class _InSlot:
    inputs: torch.Tensor | None
    targets: torch.Tensor | None
    filled: bool = False


@dataclass
class _OutSlot:
    losses: torch.Tensor
    outputs: torch.Tensor | None


class PinnedStagingFeed:
    """engine.DataFeed's interface, with the data staged through a ring of pinned host slots on the h2d stream and
    results returned on the d2h stream. See the module docstring for the data path.

    `overlap=False` is the serial baseline: every copy on the caller's stream, synchronous (the host waits after
    each copy). `refill=False` fills each pinned slot once and reuses its contents (benchmarks: keeps host data
    generation, which no single CPU thread does at PCIe speed, out of a measurement of the device pipeline).
    """

    def __init__(self, *, seed: int, replica: int, microbatches: int, inputs: list[torch.Tensor],
                 targets: list[torch.Tensor], streams: RankStreams | None, slots: int = 4, result_slots: int = 3,
                 results: str = "losses", out_shape: tuple[int, ...] | None = None,
                 out_dtype: torch.dtype = torch.float32, overlap: bool = True, refill: bool = True,
                 keep_outputs: bool = False, trace: bool = False,
                 fill: Callable[[torch.Tensor, int, int, int], None] | None = None,
                 result_buffers: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
                 main_stream: torch.cuda.Stream | None = None) -> None:
        if results not in RESULTS:
            raise ValueError(f"unknown results {results!r}; choose one of {', '.join(RESULTS)}")
        if slots < 1 or result_slots < 1:
            raise ValueError(f"slots and result_slots must be >= 1, got {slots} and {result_slots}")
        if results != "none" and not targets:
            results = "none"  # only the rank holding the last stage has results
        if results == "outputs" and out_shape is None:
            raise ValueError("results='outputs' needs out_shape (the last stage's output shape)")
        self.seed, self.replica, self.microbatches = seed, replica, microbatches
        self.inputs, self.targets = inputs, targets
        self.results = results
        self.overlap, self.refill, self.keep_outputs, self.trace = overlap, refill, keep_outputs, trace
        # A middle stage's rank (pp >= 3) holds neither inputs nor targets: the feed then does nothing.
        self.device = (inputs or targets)[0].device if (inputs or targets) else torch.device("cpu")
        self.on_gpu = self.device.type == "cuda"
        self.streams = streams if self.on_gpu else None
        # The stream the iterations run on; None: the stream current at load() (see the module docstring).
        self.main_stream = main_stream if self.on_gpu else None
        if self.on_gpu and overlap and (streams is None or streams.h2d is None or streams.d2h is None):
            raise ValueError("overlapped staging on a GPU needs the h2d and d2h streams of streams.py")
        self._generator = torch.Generator()  # CPU: the same data on every device, equal to DataFeed's on the CPU
        self._fill = fill or self._fill_batch
        gpu_overlap = self.on_gpu and overlap
        self._make_input_buffers(inputs, targets, slots, gpu_overlap)
        self._make_result_buffers(result_slots, out_shape, out_dtype, result_buffers, gpu_overlap)
        self._pending: deque[tuple[int, int, torch.cuda.Event | None]] = deque()
        self._done: list[Result] = []
        self._loaded: int | None = None  # the iteration whose data is in the static buffers
        self._main: torch.cuda.Stream | None = None  # the stream current at the last load() (no main_stream)
        self._staged_results = True  # its results were already sent back
        self.tap_mb = 0  # microbatch the result hook sees next
        self.tap_enabled = True
        self.spans: list[tuple[str, int, int, torch.cuda.Event, torch.cuda.Event]] = []  # trace=True only
        self.host_fill_s = 0.0
        self.hook_handle: torch.utils.hooks.RemovableHandle | None = None

    def _make_input_buffers(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], slots: int,
                            gpu_overlap: bool) -> None:
        """The ring of pinned input slots and, when overlapped on a GPU, the landing buffers."""
        pin = self.on_gpu
        in_shape = tuple(inputs[0].shape) if inputs else None
        tgt_shape = tuple(targets[0].shape) if targets else None
        self.in_ring = HostSlotRing([_InSlot(
            torch.empty(in_shape, pin_memory=pin) if in_shape else None,
            torch.empty(tgt_shape, pin_memory=pin) if tgt_shape else None) for _ in range(slots)])
        # Landing buffers: the second device copy of the inputs (see the module docstring).
        self._land_in = [torch.empty_like(b) for b in inputs] if gpu_overlap else []
        self._land_tgt = [torch.empty_like(b) for b in targets] if gpu_overlap else []
        # Per microbatch: the main stream has copied landing buffer mb out. Per microbatch, not per iteration, so
        # the H2D of the next iteration's first microbatches need not wait for this iteration's last one.
        self._land_free: list[torch.cuda.Event | None] = [None] * self.microbatches

    def _make_result_buffers(self, result_slots: int, out_shape: tuple[int, ...] | None, out_dtype: torch.dtype,
                             result_buffers: tuple[torch.Tensor | None, torch.Tensor | None] | None,
                             gpu_overlap: bool) -> None:
        """The static result buffers, the outbox (overlapped on a GPU) and the ring of pinned result slots."""
        m, pin, results = self.microbatches, self.on_gpu, self.results
        # torch.empty launches nothing: no work on the stream that happens to be current here (the legacy default
        # stream, outside run_iteration); the result hook writes every element before it is read.
        # `result_buffers` reuses another feed's (a graph captured with that feed's hook writes there).
        shared_loss, shared_out = result_buffers or (None, None)
        self.loss_dev = None if results == "none" else (
            shared_loss if shared_loss is not None else torch.empty(m, dtype=torch.float32, device=self.device))
        self.out_dev = None if results != "outputs" else (
            shared_out if shared_out is not None else torch.empty((m, *out_shape), dtype=out_dtype,
                                                                  device=self.device))
        self._outbox_losses = torch.empty_like(self.loss_dev) if gpu_overlap and self.loss_dev is not None else None
        self._outbox_out = torch.empty_like(self.out_dev) if gpu_overlap and self.out_dev is not None else None
        self._outbox_free: torch.cuda.Event | None = None
        self.out_ring = HostSlotRing([_OutSlot(
            torch.empty(m, dtype=torch.float32, pin_memory=pin),
            torch.empty((m, *out_shape), dtype=out_dtype, pin_memory=pin) if results == "outputs" else None)
            for _ in range(result_slots)]) if results != "none" else None

    # -- construction from a Runtime -------------------------------------------------------------------------
    @classmethod
    def from_feed(cls, feed: object, streams: RankStreams | None, *, out_spec: object | None = None,
                  **kwargs: object) -> PinnedStagingFeed:
        """Reuse a DataFeed's static buffers (the addresses a captured graph reads) and its seed/replica/M; from a
        PinnedStagingFeed, also its static result buffers (a graph captured with its hook writes into those)."""
        if out_spec is not None:
            kwargs.setdefault("out_shape", tuple(out_spec.shape))
            kwargs.setdefault("out_dtype", out_spec.dtype)
        if isinstance(feed, PinnedStagingFeed):
            kwargs.setdefault("result_buffers", (feed.loss_dev, feed.out_dev))
        return cls(seed=feed.seed, replica=feed.replica, microbatches=feed.microbatches, inputs=feed.inputs,
                   targets=feed.targets, streams=streams, **kwargs)

    def install_result_hook(self, module: nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Register the forward hook on the last stage's module that copies its output (and the microbatch's
        loss) into the static result buffers. It runs on the stage's stream, inside the iteration (and inside a
        captured graph: device copies only). The engine runs the last stage's forwards in microbatch order
        0..M-1 every iteration, in both schedules, so a counter reset by `load()` names the microbatch."""
        self.hook_handle = module.register_forward_hook(self._on_output)
        return self.hook_handle

    def _on_output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        mb = self.tap_mb % self.microbatches
        self.tap_mb += 1
        if not self.tap_enabled or self.results == "none":
            return
        y = out.detach()
        # The same expression as the engine's loss (without the 1/M), so the two agree to the bit.
        self.loss_dev[mb].copy_(F.mse_loss(y.float(), self.targets[mb]))
        if self.out_dev is not None:
            self.out_dev[mb].copy_(y)

    # -- the DataFeed interface ------------------------------------------------------------------------------
    def load(self, iteration: int) -> None:
        """Send back the results of the iteration that just ran, then stage the data of `iteration` into the
        static buffers, ordered before whatever the caller's (main) stream runs next. No host sync, except on
        a ring slot whose copy is still in flight (that one event) and in the serial mode."""
        if self.on_gpu and self.main_stream is None:
            self._main = torch.cuda.current_stream(self.device)
        with use(self._main_stream()):
            if not self._staged_results:
                self._send_results()
            if self.on_gpu and self.overlap:
                self._stage_inputs_overlapped(iteration)
            else:
                self._stage_inputs_serial(iteration)
        self._loaded = iteration
        self._staged_results = self.results == "none"
        self.tap_mb = 0

    def flush(self) -> None:
        """Send back the results of the last loaded iteration (call after the final iteration)."""
        if not self._staged_results:
            with use(self._main_stream()):  # ordered after the last iteration, whatever stream is current here
                self._send_results()
            self._staged_results = True

    def _main_stream(self) -> torch.cuda.Stream | None:
        """The stream the iterations run on (None on the CPU)."""
        if not self.on_gpu:
            return None
        if self.main_stream is not None:
            return self.main_stream
        if self._main is None:
            raise RuntimeError("the staging feed has no main stream yet: load() an iteration first")
        return self._main

    def poll(self) -> list[Result]:
        """Results whose copy back has finished (no waiting), oldest first; each is returned once."""
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            self._collect(*self._pending.popleft())
        done, self._done = self._done, []
        return done

    def drain(self) -> list[Result]:
        """flush(), then wait for every copy back in flight (a host sync: tests and the end of a run)."""
        self.flush()
        while self._pending:
            it, slot, ev = self._pending.popleft()
            if ev is not None:
                ev.synchronize()
            self._collect(it, slot, ev)
        done, self._done = self._done, []
        return done

    # -- inputs ------------------------------------------------------------------------------------------------
    def _fill_batch(self, buf: torch.Tensor, iteration: int, global_mb: int, stream_id: int) -> None:
        fill_batch(buf, self.seed, iteration, global_mb, stream_id, self._generator)

    def _fill_slot(self, slot: _InSlot, iteration: int, mb: int) -> None:
        if slot.filled and not self.refill:
            return
        t0 = time.perf_counter()
        global_mb = self.replica * self.microbatches + mb
        if slot.inputs is not None:
            self._fill(slot.inputs, iteration, global_mb, 0)
        if slot.targets is not None:
            self._fill(slot.targets, iteration, global_mb, 1)
        slot.filled = True
        self.host_fill_s += time.perf_counter() - t0

    def _stage_inputs_serial(self, iteration: int) -> None:
        """CPU, or the serial GPU baseline: on the caller's stream, synchronous copies."""
        for mb in range(self.microbatches):
            i, slot = self.in_ring.acquire()
            self._fill_slot(slot, iteration, mb)
            if self.inputs:
                self.inputs[mb].copy_(slot.inputs)  # non_blocking=False: the host waits for the copy
            if self.targets:
                self.targets[mb].copy_(slot.targets)
            self.in_ring.release(i, None)

    def _stage_inputs_overlapped(self, iteration: int) -> None:
        main = self._main_stream()
        h2d = self.streams.h2d
        ready = []
        for mb in range(self.microbatches):
            i, slot = self.in_ring.acquire()  # may wait for the event of this slot's last copy, if still busy
            self._fill_slot(slot, iteration, mb)
            if self._land_free[mb] is not None:
                h2d.wait_event(self._land_free[mb])  # main has copied the previous data of this buffer out
            with use(h2d):
                start = self._timing_event(h2d)
                if self.inputs:
                    self._land_in[mb].copy_(slot.inputs, non_blocking=True)
                if self.targets:
                    self._land_tgt[mb].copy_(slot.targets, non_blocking=True)
                done = torch.cuda.Event(enable_timing=self.trace)
                done.record(h2d)
            if start is not None:
                self.spans.append(("h2d", iteration, mb, start, done))
            self.in_ring.release(i, done)
            ready.append(done)
        for mb, ev in enumerate(ready):  # one event per microbatch; the copies into the static buffers follow
            main.wait_event(ev)
            if self.inputs:
                self.inputs[mb].copy_(self._land_in[mb], non_blocking=True)
            if self.targets:
                self.targets[mb].copy_(self._land_tgt[mb], non_blocking=True)
            free = torch.cuda.Event()
            free.record(main)
            self._land_free[mb] = free

    # -- results -----------------------------------------------------------------------------------------------
    def _send_results(self) -> None:
        if self.out_ring is None or self._loaded is None:
            return
        while len(self._pending) >= len(self.out_ring):
            # The ring comes round to a slot whose results nobody polled yet: read them out before it is reused
            # (waiting on that copy's event, as acquire() would).
            it, slot, ev = self._pending.popleft()
            if ev is not None:
                ev.synchronize()
            self._collect(it, slot, ev)
        if not (self.on_gpu and self.overlap):
            i, slot = self.out_ring.acquire()
            slot.losses.copy_(self.loss_dev)  # synchronous
            if slot.outputs is not None:
                slot.outputs.copy_(self.out_dev)
            self.out_ring.release(i, None)
            self._pending.append((self._loaded, i, None))
            return
        main = self._main_stream()
        d2h = self.streams.d2h
        if self._outbox_free is not None:
            main.wait_event(self._outbox_free)  # the previous copy back has read the outbox
        # The engine joined every stage stream into main at the end of the iteration: main orders after the hook.
        self._outbox_losses.copy_(self.loss_dev, non_blocking=True)
        if self._outbox_out is not None:
            self._outbox_out.copy_(self.out_dev, non_blocking=True)
        filled = torch.cuda.Event()
        filled.record(main)
        d2h.wait_event(filled)
        i, slot = self.out_ring.acquire()
        with use(d2h):
            start = self._timing_event(d2h)
            slot.losses.copy_(self._outbox_losses, non_blocking=True)
            if slot.outputs is not None:
                slot.outputs.copy_(self._outbox_out, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.trace)
            done.record(d2h)
        if start is not None:
            self.spans.append(("d2h", self._loaded, -1, start, done))
        self.out_ring.release(i, done)
        self._outbox_free = done
        self._pending.append((self._loaded, i, done))

    def _collect(self, iteration: int, slot_index: int, event: torch.cuda.Event | None) -> None:
        slot = self.out_ring.slots[slot_index]
        outputs = slot.outputs.clone() if (self.keep_outputs and slot.outputs is not None) else None
        self._done.append(Result(iteration, slot.losses.clone(), outputs))

    def _timing_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        if not self.trace:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    # -- benchmark helpers: the copies alone, to measure the bound max(H2D, compute, D2H) ----------------------
    def copy_in_alone(self) -> None:
        """Enqueue one iteration's H2D copies (pinned slots -> landing buffers, round robin over the slots) on the
        h2d stream, with no other dependency. Only for timing; the landing data is then stale."""
        with use(self.streams.h2d):
            for mb in range(self.microbatches):
                slot = self.in_ring.slots[mb % len(self.in_ring)]
                if self.inputs:
                    self._land_in[mb].copy_(slot.inputs, non_blocking=True)
                if self.targets:
                    self._land_tgt[mb].copy_(slot.targets, non_blocking=True)

    def copy_out_alone(self) -> None:
        """Enqueue one iteration's D2H copies (outbox -> a pinned result slot) on the d2h stream, alone."""
        if self.out_ring is None:
            return
        slot = self.out_ring.slots[0]
        with use(self.streams.d2h):
            slot.losses.copy_(self._outbox_losses, non_blocking=True)
            if slot.outputs is not None:
                slot.outputs.copy_(self._outbox_out, non_blocking=True)

    def detach(self) -> None:
        """Remove the result hook installed by attach()/install_result_hook()."""
        if self.hook_handle is not None:
            self.hook_handle.remove()
            self.hook_handle = None

    def stats(self) -> dict[str, float]:
        """Ring waits (host waited on a slot's event), slots handed out, host fill seconds."""
        out = {"in_slot_waits": self.in_ring.waits, "in_slots_acquired": self.in_ring.acquired,
               "host_fill_s": self.host_fill_s}
        if self.out_ring is not None:
            out.update(out_slot_waits=self.out_ring.waits, out_slots_acquired=self.out_ring.acquired)
        return out


def pinned_feed(feed: object, streams: RankStreams | None, last_local: object, **kwargs: object
                ) -> PinnedStagingFeed:
    """A PinnedStagingFeed over `feed`'s static buffers, with its result hook on `last_local` (this rank's last
    local stage) when that stage is the pipeline's last. The runtime's assembly builds the engine with it."""
    staged = PinnedStagingFeed.from_feed(feed, streams, out_spec=last_local.out_spec, **kwargs)
    if last_local.is_last:
        staged.install_result_hook(last_local.module)
    return staged


def attach(rt: object, **kwargs: object) -> PinnedStagingFeed:
    """Give a built Runtime's engine a new PinnedStagingFeed (`Engine.use_feed`) over its feed's static buffers and
    return it. Attach before the iteration is captured (after the warm-up iterations), so the graph holds the
    result copies; a feed attached later replaces (and detaches) the old one and shares its result buffers, which
    the graph writes."""
    engine = rt.engine
    if isinstance(engine.feed, PinnedStagingFeed):
        engine.feed.detach()
    kwargs.setdefault("main_stream", engine.main_stream)
    feed = pinned_feed(engine.feed, rt.streams, engine.stages[engine.order[-1]], **kwargs)
    engine.use_feed(feed)
    return feed
