"""`--overlap-param-gather`: the sharded step's parameter all-gathers run beside the next iteration's forward.

Without it, ShardedGradBuckets (sharded.py) all-gathers every bucket's updated shard right after the optimizer step
and the main stream waits for all of them, so on a GPU the whole gather is exposed at the end of each iteration.
With it, one iteration of a stage goes:

  start()      first thing in the iteration (Engine.at_iteration_start, on the main stream): every bucket's
               all-gather of the shards the last step updated, on the all-reduce stream after the step, in the
               order the forward reads the buckets (backward filled them last layer first: roughly reversed); an
               event is recorded after each (gloo: its Work is kept)
  forward      a pre-hook on the first layer that reads a bucket's parameters makes the current (compute) stream
               wait for that bucket's event only, the first time the layer runs in the iteration
  finish()     ShardedGradBuckets.finish waits for any bucket no forward waited for (`wait_all`): its all-gather
               reads the shard that the step writes next
  step         updates the shards; gathers nothing (ShardedGradBuckets.after_step)

Why at the head of the next iteration rather than at the end of the step: a captured iteration must join every
stream it forked before its capture ends, and a graph replay runs whole before the next launch on its stream starts,
so a gather issued at the end of iteration N could never run beside the forward of replay N+1. Issued first in N+1,
inside the same graph as the events it records and the waits on them, it follows the step with nothing between on
the GPU but the launch boundary, eagerly and in graphs alike. Nothing here allocates or waits on the host after the
events are made (gloo's Work objects are CPU only), so the iteration stays capturable.

Between iterations the parameters are stale (only the shards hold the last step). Whatever reads them there
(checksums, checkpoints, the end of training) calls Engine.finish_parameter_gathers(), which runs `gather_now` (the
all-gathers, waited for; collective over the dp group). The next iteration gathers the same values again, so no
host state has to track which launches, graph replays included, left the parameters stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from peerline.distributed.grad_sync.buckets import Bucket


def first_readers(buckets: Sequence[Bucket], layers: Sequence[nn.Module]) -> list[int]:
    """Per bucket, the index of the first layer (in forward order) that holds one of its parameters; a layer
    sharing a parameter with a later one reads it first."""
    first: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            first.setdefault(id(p), i)
    missing = [b.index for b in buckets if not any(id(p) in first for p in b.params)]
    if missing:
        raise ValueError(f"bucket {missing[0]} holds no parameter of the stage's layers")
    return [min(first[id(p)] for p in b.params if id(p) in first) for b in buckets]


def forward_order(readers: Sequence[int]) -> list[int]:
    """Bucket indices in the order the forward reads them: by first reading layer, and among the buckets one layer
    reads first, the highest index first (backward closed it last, so it holds that layer's earliest parameters)."""
    return sorted(range(len(readers)), key=lambda i: (readers[i], -i))


class ParamGather:
    """The overlapped all-gathers of one stage's ShardedGradBuckets (see the module doc). `layers`: the stage's
    layers in forward order (the children of its nn.Sequential, as its buckets were planned from). Attaching sets
    `sync.overlap`, so the step no longer gathers; `close()` detaches again."""

    def __init__(self, sync: Any, layers: Sequence[nn.Module]) -> None:
        self.sync = sync
        readers = first_readers(sync.buckets, layers)
        #: bucket indices in issue order (the forward's)
        self.order = forward_order(readers)
        self._events = [torch.cuda.Event() for _ in sync.buckets] if sync.on_cuda else []
        self._pending: list[Any] = [None] * len(sync.buckets)  # per bucket: gloo's Work, True (an event), None
        waits: dict[int, list[int]] = {}
        for i in self.order:
            waits.setdefault(readers[i], []).append(i)
        self._hooks = [layers[layer].register_forward_pre_hook(self._make_hook(buckets))
                       for layer, buckets in waits.items()]
        sync.overlap = self

    def start(self) -> None:
        """Issue every bucket's all-gather in forward order (on a GPU on the all-reduce stream, after the current
        stream's queued work, i.e. the step), each on the bucket's own group (the first layers' buckets on the
        uncapped tail group, as their reduce-scatters: the forward waits for them first)."""
        sync = self.sync
        if not sync.on_cuda:
            for i in self.order:
                self._pending[i] = sync.gather_bucket(i, sync.bucket_groups[i], async_op=True)
            return
        current = torch.cuda.current_stream(sync.device)
        stream = sync.stream if sync.stream is not None else current
        if stream != current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for i in self.order:
                sync.gather_bucket(i, sync.bucket_groups[i])  # NCCL on the current stream: no Work, no host wait
                self._events[i].record(stream)
                self._pending[i] = True

    def wait(self, index: int) -> None:
        """Order the current stream after bucket `index`'s all-gather (gloo: wait for it); once per start()."""
        pending, self._pending[index] = self._pending[index], None
        if pending is None:
            return
        if self.sync.on_cuda:
            torch.cuda.current_stream(self.sync.device).wait_event(self._events[index])
        else:
            pending.wait()

    def wait_all(self) -> None:
        """Wait for every all-gather not waited for yet."""
        for i in self.order:
            self.wait(i)

    def gather_now(self) -> None:
        """Make the parameters whole now, the current stream ordered after it (between iterations; collective)."""
        self.start()
        self.wait_all()

    def close(self) -> None:
        """Remove the forward pre-hooks and give the gathering back to the step (outside an iteration)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.sync.overlap = None

    def _make_hook(self, buckets: list[int]) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            for i in buckets:
                self.wait(i)
        return hook
