"""Flat gradient buckets, all-reduced over the data-parallel group as they fill during backward.

Every parameter's `.grad` is a view into a flat buffer (one per dtype), cut into buckets in the order gradients
become ready in backward: last layer first, filled as DDP fills its buckets (`plan_buckets`: a parameter joins the
open bucket until that reaches its cap, so a big weight closes the bucket it joins and small parameters ride with
the next big one; only the last bucket can be small), a small first bucket (1 MiB, as DDP) so communication
starts early, then `bucket_mb` buckets.

One iteration, as the engine drives it:

  zero_grad()   zero the flat buffers (the views stay the parameters' `.grad`)
  ...           backward of microbatches 0..M-2 accumulate into the buckets; the hooks do nothing
  arm()         before the LAST microbatch's backward
  ...           each parameter's post-accumulate-grad hook counts it final; when a bucket is complete, an event
                on the current (compute) stream releases the bucket's all-reduce on the all-reduce stream
                (highest priority, see streams.py). Buckets launch in index order on every rank, so all ranks
                issue the same NCCL sequence even if autograd finishes parameters in another order.
  finish()      after the last backward: launch what is left (parameters that got no gradient), make the
                current stream wait on the last bucket (the all-reduce stream is in order, so that covers all)
  metrics()     after the iteration (synchronizes): all-reduce time, exposed time, hidden share, busbw

A parameter that gets no gradient in the last microbatch holds back its bucket, and (launch order) every
bucket after it, until finish(): keep such parameters early in the model, so their buckets come last.

Nothing between arm() and finish() synchronizes the host, so the iteration can be captured in a CUDA graph:
the events are created here once and reused; timing events are recorded only when enabled (under capture,
external timing events, so a replay's times can be read after it). Run at least one eager iteration with
arm()/finish() before capturing: it creates NCCL's communicator and the events.

NCCL's kernels take SMs: each bucket's all-reduce runs one CTA per NCCL channel, and on the highest-priority
stream those CTAs are scheduled ahead of the backward GEMMs they overlap with, which slows backward down
(docs/benchmarks/code-notes.md has the figure). The SMs belong to the group's communicator, fixed when the
group is created: create the dp group with `nccl_options(max_ctas=N)` (bench/suites/allreduce.py measures caps)
to trade bus bandwidth for less interference. GradBuckets itself takes whatever group it is given.

NCCL averages with ReduceOp.AVG. Gloo (CPU) has no AVG: it sums asynchronously (gloo's own threads overlap
with the rest of backward) and finish() divides by dp after waiting, which is bitwise what a per-parameter
`all_reduce(SUM)` followed by `/ dp` gives. dp = 1 (or no group): no hooks, no collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from peerline.kernels.capture_state import capturing

log = logging.getLogger(__name__)

MiB = 1 << 20
#: every parameter starts at a multiple of this many bytes of its flat buffer (vector loads, NCCL alignment)
ALIGN_BYTES = 256


@dataclass(slots=True)
class Bucket:
    """One contiguous slice of a dtype's flat buffer and the parameters whose gradients live in it."""

    index: int
    dtype: torch.dtype
    offset: int  # first element in the flat buffer of `dtype`
    numel: int  # elements, alignment padding included
    params: list[torch.nn.Parameter] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # element offset of each parameter inside the bucket

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(numel: int, dtype: torch.dtype) -> int:
    step = max(1, ALIGN_BYTES // _itemsize(dtype))
    return -(-numel // step) * step


def ready_order(layers: Sequence[Sequence[torch.nn.Parameter]]) -> list[torch.nn.Parameter]:
    """Parameters in the order backward finishes them: last layer first, and inside a layer the reverse of
    registration (a block's output projection is differentiated before its input projection). Parameters that
    need no gradient are left out; a parameter listed twice (tied weights) counts once."""
    seen: set[int] = set()
    order = []
    for layer in reversed(layers):
        for p in reversed(list(layer)):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    return order


def plan_buckets(params: Sequence[torch.nn.Parameter], bucket_mb: float, first_bucket_mb: float) -> list[Bucket]:
    """Cut `params` (in ready order) into buckets the way DDP does (its `compute_bucket_assignment_by_size`).

    Parameters are appended, in ready order, to the open bucket of their dtype until that bucket reaches its cap;
    the parameter that reaches (or overshoots) the cap is the bucket's last, and the bucket closes. So a
    parameter larger than the cap closes the bucket it joins, and the small parameters ready just before it
    (biases, norms) ride with it instead of forming a bucket of a few KiB of their own: every closed bucket holds
    at least its cap, and only a dtype's last bucket (what is left at the end of backward) can be smaller. The
    first bucket of each dtype has the small cap (`first_bucket_mb`, 1 MiB as DDP) so the first all-reduce
    starts early; the others `bucket_mb`. Each dtype keeps its own open bucket (as DDP), so a model that mixes
    dtypes does not cut a bucket at every dtype change.

    Buckets are numbered in the order they close, i.e. by their last parameter's place in ready order: the order
    they become complete in backward, which is the launch order. Each dtype's buckets tile its flat buffer in
    that order.

    Why: a small bucket costs a whole NCCL launch and its latency for a few KiB; cutting one bucket per large
    weight instead would leave the small parameters in buckets of their own.
    """
    if bucket_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(f"bucket sizes must be positive, got bucket_mb={bucket_mb} first_bucket_mb={first_bucket_mb}")
    first_cap, cap = int(first_bucket_mb * MiB), int(bucket_mb * MiB)
    closed: list[tuple[int, Bucket]] = []  # (ready position of the last parameter, bucket)
    flat_end: dict[torch.dtype, int] = {}
    open_: dict[torch.dtype, Bucket] = {}
    last_pos: dict[torch.dtype, int] = {}
    count: dict[torch.dtype, int] = {}  # buckets closed per dtype: the first one gets the small cap

    for pos, p in enumerate(params):
        dt = p.dtype
        b = open_.get(dt)
        if b is None:
            b = open_[dt] = Bucket(-1, dt, flat_end.get(dt, 0), 0)
        size = _aligned(p.numel(), dt)
        b.params.append(p)
        b.starts.append(b.numel)
        b.numel += size
        last_pos[dt] = pos
        if b.nbytes >= (first_cap if count.get(dt, 0) == 0 else cap):
            closed.append((pos, b))
            flat_end[dt] = b.offset + b.numel
            count[dt] = count.get(dt, 0) + 1
            del open_[dt]
    closed.extend((last_pos[dt], b) for dt, b in open_.items())  # each dtype's remainder: its last bucket
    closed.sort(key=lambda t: t[0])
    buckets = [b for _, b in closed]
    for i, b in enumerate(buckets):
        b.index = i
    return buckets


def nccl_options(max_ctas: int | None = None, min_ctas: int | None = None, backend: str | None = "nccl") -> Any:
    """`ProcessGroupNCCL.Options` for `dist.new_group(ranks, pg_options=...)` that cap the CTAs (thread blocks,
    so SMs) the group's NCCL kernels may take: NCCL's `ncclConfig_t.maxCTAs` / `minCTAs`, per communicator.

    Why: the bucket all-reduces run on the highest-priority stream, so their kernels get SMs ahead of the
    backward GEMMs they overlap with; NCCL's default (up to 32 channels, one CTA each, on NVLink) can slow
    backward by more than the all-reduce it hides. Fewer CTAs: less bus bandwidth, less interference.

    Returns None (the backend's defaults) when no cap is asked, when `backend` is not NCCL (gloo ignores it),
    or when this torch has no NCCL (CPU builds). A group's communicator is created with its options: pass
    this where the data-parallel group is created (every rank, same order, as any new_group).
    """
    for name, v in (("max_ctas", max_ctas), ("min_ctas", min_ctas)):
        if v is not None and not 1 <= v <= 64:
            raise ValueError(f"nccl {name} must be in 1..64 (NCCL's MAXCHANNELS), got {v}")
    if max_ctas is not None and min_ctas is not None and min_ctas > max_ctas:
        raise ValueError(f"nccl min_ctas {min_ctas} > max_ctas {max_ctas}")
    if (max_ctas is None and min_ctas is None) or (backend is not None and "nccl" not in str(backend).lower()):
        return None
    if not dist.is_nccl_available():
        log.info("NCCL not available: CTA cap ignored")
        return None
    opts = dist.ProcessGroupNCCL.Options()
    # pybind's def_readwrite returns the struct by reference: these assignments change opts.config itself.
    if max_ctas is not None:
        opts.config.max_ctas = max_ctas
    if min_ctas is not None:
        opts.config.min_ctas = min_ctas
    return opts


class GradBuckets:
    """The gradient-sync object of one stage: flat buckets, hooks, all-reduce, metrics (see the module doc).

    `tail_group` (optional; the same ranks as `group`, e.g. NCCL's default CTAs where `group` caps them): the
    buckets holding a parameter of the first `tail_layers` layers, which backward finishes last, are all-reduced
    on it. Nothing is left in backward to overlap those with, so a CTA cap that spares backward's GEMMs only
    slows them down. Which bucket uses which group is fixed here, so every rank issues the same sequence; the
    all-reduce stream keeps the two communicators' collectives in order.
    """

    def __init__(self, layers: Sequence[Sequence[torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 device: torch.device, stream: torch.cuda.Stream | None = None, bucket_mb: float = 25,
                 first_bucket_mb: float = 1, timing: bool = True, tail_group: dist.ProcessGroup | None = None,
                 tail_layers: int = 1) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.stream = stream if self.device.type == "cuda" else None
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.on_cuda = self.device.type == "cuda"
        self.buckets = plan_buckets(ready_order(layers), bucket_mb, first_bucket_mb)
        # Replicas of a stage hold the same parameters, so every rank of the group agrees on this.
        self.reduce = self.dp > 1 and bool(self.buckets)
        self.bucket_groups = self._bucket_groups(layers, group, tail_group, tail_layers)
        # AVG exists on NCCL (>= 2.10) only; gloo sums and finish() divides.
        self._use_avg = self.reduce and self.on_cuda and "nccl" in str(dist.get_backend(group)).lower()
        self._build_flat()

        # Per-iteration host state (touched only by arm/hooks/finish, never by the device).
        self._armed = False
        self._pending = [len(b.params) for b in self.buckets]
        self._seen = [[False] * len(b.params) for b in self.buckets]
        self._next = 0  # first bucket not launched yet
        self._launched_in_backward = 0
        self._works: list[Any] = []
        self._hooks = []
        if self.reduce:
            for b in self.buckets:
                for slot, p in enumerate(b.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(b.index, slot)))

        self._ready = self._done = []
        if self.on_cuda:
            self._ready = [torch.cuda.Event() for _ in self.buckets]
            self._done = [torch.cuda.Event() for _ in self.buckets]
        self._timers = _Timers(self.on_cuda, len(self.buckets), timing and self.reduce)
        tail = sum(g is not group for g in self.bucket_groups)
        log.info("grad buckets: %d buckets, %s, dp=%d, %s%s", len(self.buckets),
                 ", ".join(f"{b.nbytes / MiB:.2f}" for b in self.buckets) + " MiB", self.dp,
                 "nccl avg" if self._use_avg else ("sum / dp" if self.reduce else "no all-reduce"),
                 f", last {tail} on the tail group" if tail else "")

    def _bucket_groups(self, layers: Sequence[Sequence[torch.nn.Parameter]], group: dist.ProcessGroup | None,
                       tail_group: dist.ProcessGroup | None, tail_layers: int) -> list[dist.ProcessGroup | None]:
        """The group each bucket is all-reduced on: `tail_group` for buckets holding a parameter of the first
        `tail_layers` layers (backward finishes them last), `group` for the others."""
        if tail_group is not None and group is not None and dist.get_world_size(tail_group) != self.dp:
            raise ValueError(f"tail_group has {dist.get_world_size(tail_group)} ranks, the dp group {self.dp}")
        tail_ids = {id(p) for layer in layers[:max(0, tail_layers)] for p in layer} if tail_group is not None else set()
        return [tail_group if any(id(p) in tail_ids for p in b.params) else group for b in self.buckets]

    def _build_flat(self) -> None:
        """One zeroed flat buffer per dtype, each parameter's `.grad` made a view into its bucket's slice."""
        sizes: dict[torch.dtype, int] = {}
        for b in self.buckets:
            sizes[b.dtype] = max(sizes.get(b.dtype, 0), b.offset + b.numel)
        self.flat = {dt: torch.zeros(n, dtype=dt, device=self.device) for dt, n in sizes.items()}
        self._slices = [self.flat[b.dtype][b.offset:b.offset + b.numel] for b in self.buckets]
        # per bucket, per slot: the parameter, its view into the bucket and the view's address, so zero_grad and a
        # hook compare one integer instead of slicing a tensor (hooks run on autograd's thread while the host races
        # ahead of the GPU in eager mode)
        self._slots: list[list[tuple[torch.nn.Parameter, torch.Tensor, int]]] = []
        for b, flat in zip(self.buckets, self._slices, strict=True):
            slots = []
            for p, start in zip(b.params, b.starts, strict=True):
                if p.device != self.device:
                    raise ValueError(f"parameter on {p.device}, buckets on {self.device}")
                view = flat[start:start + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                slots.append((p, view, view.data_ptr()))
            self._slots.append(slots)
        if self.on_cuda:
            # The buffers were written on whatever stream built us; the compute and all-reduce streams are
            # non-blocking and would not wait for that. Construction is outside any iteration: a host wait is fine.
            torch.cuda.current_stream(self.device).synchronize()

    # -- the engine's interface ---------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero every bucket; re-point a `.grad` that someone replaced (e.g. set_to_none) back at its view."""
        for slots in self._slots:
            for p, view, address in slots:
                if p.grad is None or p.grad.data_ptr() != address:
                    p.grad = view
        for flat in self.flat.values():
            flat.zero_()

    def arm(self) -> None:
        """From now on, a bucket whose parameters all have their final gradient is all-reduced."""
        self._reset()
        self._armed = self.reduce
        self._timers.begin()

    def finish(self) -> None:
        """Launch what is left, order the current stream after the last bucket's all-reduce, disarm."""
        if not self.reduce:
            self._armed = False
            return
        current = torch.cuda.current_stream(self.device) if self.on_cuda else None
        self._timers.mark("bwd_end", current)
        for i in range(self._next, len(self.buckets)):
            if self._pending[i] > 0:  # parameters without a gradient this iteration: their zeros are reduced
                self._pending[i] = 0
                self._mark_ready(i)
        self._launch_ready()
        if self.on_cuda:
            if self.stream is not None:
                current.wait_event(self._done[-1])
        else:
            for work, result in self._works:
                work.wait()
                result.div_(self.dp)
        self._timers.mark("opt_start", current)
        self._timers.end()
        self._armed = False

    def metrics(self) -> dict[str, Any]:
        """Figures of the last timed iteration (synchronizes with it). Times in ms; busbw in GB/s."""
        out: dict[str, Any] = {"dp": self.dp, "buckets": len(self.buckets),
                               "bucket_bytes": [b.nbytes for b in self.buckets],
                               "launched_in_backward": self._launched_in_backward}
        if not self.reduce:
            return {**out, "allreduce_ms": 0.0, "exposed_ms": 0.0, "hidden_share": 1.0, "timed": True}
        t = self._timers.read()
        if t is None:
            return {**out, "timed": False}
        bucket_ms, exposed = t["buckets"], t["exposed"]
        total = sum(bucket_ms) if bucket_ms is not None else t["span"]
        factor = 2 * (self.dp - 1) / self.dp  # ring all-reduce bus bandwidth (nccl-tests convention)
        busbw = [b.nbytes / (ms * 1e-3) / 1e9 * factor if ms > 0 else float("nan")
                 for b, ms in zip(self.buckets, bucket_ms, strict=True)] if bucket_ms is not None else None
        hidden = 1.0 - min(1.0, exposed / total) if total > 0 else 1.0
        return {**out, "allreduce_ms": total, "exposed_ms": exposed, "hidden_share": hidden, "bucket_ms": bucket_ms,
                "bucket_busbw_gbs": busbw, "clock": "cuda" if self.on_cuda else "host", "timed": True}

    @property
    def bucket_tensors(self) -> list[torch.Tensor]:
        """Each bucket's slice of its flat buffer, in launch order (benchmarks all-reduce the layout alone)."""
        return list(self._slices)

    def close(self) -> None:
        """Remove the hooks (the views stay the parameters' gradients)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- internals ----------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._pending = [len(b.params) for b in self.buckets]
        for seen in self._seen:
            seen[:] = [False] * len(seen)
        self._next = 0
        self._launched_in_backward = 0
        self._works = []

    def _make_hook(self, index: int, slot: int):
        def hook(param: torch.Tensor) -> None:
            if self._armed:
                self._param_ready(index, slot, param)
        return hook

    def _param_ready(self, index: int, slot: int, param: torch.Tensor) -> None:
        if self._seen[index][slot]:
            # A second accumulation after the bucket may have launched would be lost on the other ranks.
            raise RuntimeError(f"gradient of a parameter in bucket {index} accumulated twice after arm(): "
                               "arm() must come right before the last backward of the iteration")
        self._seen[index][slot] = True
        _, view, address = self._slots[index][slot]
        if param.grad is None or param.grad.data_ptr() != address:
            # Someone replaced .grad (set_to_none, an assignment): fold it back into the bucket.
            view.copy_(param.grad)
            param.grad = view
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._mark_ready(index)
            before = self._next
            self._launch_ready()
            self._launched_in_backward += self._next - before

    def _mark_ready(self, index: int) -> None:
        if self.on_cuda and self.stream is not None:
            # The hook runs under the stream AccumulateGrad ran on (autograd's stream guard): record there.
            self._ready[index].record(torch.cuda.current_stream(self.device))

    def _launch_ready(self) -> None:
        """Launch complete buckets in index order, so every rank issues the same sequence of collectives."""
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        if not self.on_cuda:
            self._timers.launched(index)
            self._works.append(self._collective(index, dist.ReduceOp.SUM, async_op=True))
            return
        op = dist.ReduceOp.AVG if self._use_avg else dist.ReduceOp.SUM
        # Without an all-reduce stream the collective runs in order on the current stream (no overlap).
        stream = self.stream if self.stream is not None else torch.cuda.current_stream(self.device)
        if self.stream is not None:
            stream.wait_event(self._ready[index])
        with torch.cuda.stream(stream):
            self._timers.bucket_start(index, stream)
            # async_op=False: NCCL enqueues on the current (all-reduce) stream; no Work, no host wait.
            _, result = self._collective(index, op, async_op=False)
            if not self._use_avg:
                result.div_(self.dp)
            self._timers.bucket_end(index, stream)
            self._done[index].record(stream)

    def _collective(self, index: int, op: Any, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Bucket `index`'s collective on its group: the all-reduce in place here (grad_sync/sharded.py
        reduce-scatters instead). Returns (Work or None, the tensor that holds the reduced sum or average)."""
        flat = self._slices[index]
        return dist.all_reduce(flat, op=op, group=self.bucket_groups[index], async_op=async_op), flat


class _Timers:
    """Optional timing of one iteration: CUDA events (external ones under graph capture) or the host clock.

    Eager and captured iterations use separate events: an event recorded under capture is a graph node, and its
    times after a replay are that replay's. Nothing here synchronizes until read()."""

    def __init__(self, on_cuda: bool, n: int, enabled: bool) -> None:
        self.on_cuda, self.n, self.enabled = on_cuda, n, enabled
        self._sets: dict[bool, dict[str, list[Any]]] = {}
        if enabled and on_cuda:
            self._sets[False] = self._make(external=False)
            try:
                self._sets[True] = self._make(external=True)
            except (TypeError, RuntimeError) as exc:  # torch without external events: captures go untimed
                log.info("external CUDA events unavailable (%s): captured iterations are not timed", exc)
        self._events: dict[str, list[Any]] | None = None  # the set the current iteration records into
        self._host: dict[str, Any] | None = None  # CPU: perf_counter marks of the current iteration
        self._last: tuple[str, Any] | None = None  # ("cuda", events) or ("host", marks) of the last timed one

    def _make(self, external: bool) -> dict[str, list[Any]]:
        def ev() -> torch.cuda.Event:
            # Only pass `external` when needed, so older torch still times eager iterations.
            return torch.cuda.Event(enable_timing=True, external=True) if external else \
                torch.cuda.Event(enable_timing=True)
        return {"start": [ev() for _ in range(self.n)], "end": [ev() for _ in range(self.n)],
                "bwd_end": [ev()], "opt_start": [ev()]}

    def begin(self) -> None:
        self._events, self._host = None, None
        if not self.enabled:
            return
        if self.on_cuda:
            self._events = self._sets.get(capturing())
        else:
            self._host = {"launch": [None] * self.n}

    def bucket_start(self, i: int, stream: torch.cuda.Stream) -> None:
        if self._events is not None:
            self._events["start"][i].record(stream)

    def bucket_end(self, i: int, stream: torch.cuda.Stream) -> None:
        if self._events is not None:
            self._events["end"][i].record(stream)

    def launched(self, i: int) -> None:
        if self._host is not None:
            self._host["launch"][i] = time.perf_counter()

    def mark(self, name: str, stream: torch.cuda.Stream | None) -> None:
        if self._events is not None:
            self._events[name][0].record(stream)
        elif self._host is not None:
            self._host[name] = time.perf_counter()

    def end(self) -> None:
        """Close the iteration: its marks become the ones read() resolves (until the next timed iteration)."""
        if self._events is not None:
            self._last = ("cuda", self._events)
        elif self._host is not None:
            self._last = ("host", self._host)
        self._events, self._host = None, None

    def read(self) -> dict[str, Any] | None:
        if self._last is None:
            return None
        kind, marks = self._last
        if kind == "host":
            first = min((t for t in marks["launch"] if t is not None), default=marks["bwd_end"])
            return {"buckets": None, "span": (marks["opt_start"] - first) * 1e3,
                    "exposed": (marks["opt_start"] - marks["bwd_end"]) * 1e3}
        try:
            marks["opt_start"][0].synchronize()
            marks["end"][-1].synchronize()
            pairs = zip(marks["start"], marks["end"], strict=True)
            return {"buckets": [s.elapsed_time(e) for s, e in pairs], "span": None,
                    "exposed": marks["bwd_end"][0].elapsed_time(marks["opt_start"][0])}
        except RuntimeError as exc:  # e.g. events of a capture that was never replayed
            log.debug("bucket timing unreadable: %s", exc)
            return None
