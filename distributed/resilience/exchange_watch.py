"""The watchdog's view of the pipeline edges: which edge, microbatch and peer rank an exchange waits for.

`ExchangeWatch` is the engine's exchange observer (`Engine.exchange_observer`). Before each exchange with another
rank it tells the watchdog what the exchange waits for. On the CPU a receive blocks the host, so that description
is what a timeout names. On a GPU the host only queues the wait and moves on; so after each receive an event is
recorded on the stream that waits (external events: they become graph nodes under capture, and replays record
them again), and at a timeout `describe_stall` names the first receive whose event has not completed: the edge and
microbatch the device is stuck on. The count of those events the device has passed is the watchdog's progress
probe: a long iteration of quick handoffs is progress, not a hang.

`name_collective_waits` names the other waits of an iteration for the watchdog (the data-parallel gradient
all-reduce, with the replicas' ranks), and `attach_heartbeat` gives the watchdog every rank's beats (heartbeat.py)
so its line names the rank that stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import _torchelastic_use_agent_store

from peerline.distributed.p2p.base import ACT, Links
from peerline.distributed.p2p.edges import host_of
from peerline.distributed.pipeline.engine import MessageLabel
from peerline.distributed.resilience.device_query import EventQuery
from peerline.distributed.resilience.heartbeat import Heartbeat, own_connection
from peerline.distributed.resilience.watchdog import Watchdog, describe_edge, stage_label


class ExchangeWatch:
    """See the module docstring."""

    def __init__(self, links: Links | None, watchdog: Watchdog | None) -> None:
        self.links = links
        self.watchdog = watchdog
        self._arrived: dict[tuple[str, int], torch.cuda.Event] = {}  # one per (kind, mb), reused every iteration
        self._order: list[tuple[torch.cuda.Event, str]] = []  # this iteration's receives, in the order queued
        self._stale = False  # a new iteration began: the first receive it queues starts a new order
        self._query: EventQuery | None = None  # made on the main thread at the first receive on a GPU
        self._receiving: list[str] = []  # the descriptions of the receives of the exchange under way

    def new_iteration(self) -> None:
        """An iteration begins. A replayed graph queues no receive from the host: the captured order stays."""
        self._stale = True

    def describe_stall(self) -> str | None:
        """The first receive of the iteration that the device has not got past, or None (host-side hang, or all
        done). Only queries events, without the GIL (device_query.py): safe from the watchdog thread while streams
        and the main thread are blocked."""
        if not self._order or self._query is None:
            return None
        for event, desc in list(self._order):
            if not self._query.done(event):
                return f"{desc} (the device is stuck there)"
        return None

    def passed(self) -> int:
        """How many of this iteration's receives the device has got past (the watchdog's progress probe)."""
        if not self._order or self._query is None:
            return 0
        return sum(1 for event, _ in list(self._order) if self._query.done(event))

    # -- the engine's exchange observer ------------------------------------------------------------------------
    def on_exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]],
                    send_labels: list[MessageLabel], recv_labels: list[MessageLabel]) -> None:
        """Name what the exchange about to be posted waits for: each message's kind, microbatch and stages from
        its label, the peer rank from the channel that carries it."""
        self._receiving = [self._describe(label, channel, False)
                           for label, (channel, _id) in zip(recv_labels, recvs, strict=True)]
        parts = self._receiving + [self._describe(label, channel, True)
                                   for label, (channel, _id, _t) in zip(send_labels, sends, strict=True)]
        if parts and self.watchdog is not None:
            peers = {self.links.peer(kind, False) for kind, _ in recvs} | {self.links.peer(kind, True)
                                                                          for kind, _, _ in sends}
            self.watchdog.waiting_for(", ".join(parts), ranks=sorted(p for p in peers if p is not None))

    def after_exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]],
                       received: list[torch.Tensor]) -> None:
        """The exchange is done on the host (progress); on a GPU, record an arrival event after each receive (what
        `describe_stall` queries)."""
        if self.watchdog is not None:
            self.watchdog.progress()
        if not received or not received[0].is_cuda:
            return
        if self._stale:
            self._order.clear()
            self._stale = False
        if self._query is None:
            self._query = EventQuery()
        stream = torch.cuda.current_stream(received[0].device)
        for (kind, mb), desc in zip(recvs, self._receiving, strict=True):
            event = self._arrived.get((kind, mb))
            if event is None:
                event = self._arrived[(kind, mb)] = torch.cuda.Event(external=True)
            event.record(stream)
            self._order.append((event, desc))

    def _describe(self, label: MessageLabel, channel: str, sending: bool) -> str:
        # Over boundary b an activation goes from stage b to b+1, a gradient from b+1 to b.
        kind, boundary, mb = label
        src, dst = (boundary, boundary + 1) if kind == ACT else (boundary + 1, boundary)
        here, there = (src, dst) if sending else (dst, src)
        peer = self.links.peer(channel, sending) if self.links is not None else "?"
        return describe_edge(kind, mb, peer, here, there, sending=sending)


def name_collective_waits(engine: Any, watchdog: Watchdog, mesh: Any) -> None:
    """Name the gradient all-reduce's host wait for the watchdog (the replicas' ranks), and count its end as
    progress: each local stage's grad sync `finish` is wrapped (on a GPU it only orders streams: no host wait)."""
    if mesh.dp == 1:
        return
    for stage in engine.stages.values():
        sync = stage.grad_sync
        replicas = [r for r in mesh.dp_ranks(mesh.stage) if r != mesh.rank]
        desc = (f"the gradient all-reduce of stage {stage.index} with "
                f"{', '.join(f'rank {r} (replica {r // mesh.pp})' for r in replicas)}")
        sync.finish = _named(sync.finish, watchdog, desc, replicas)


def _named(wait: Callable[[], None], watchdog: Watchdog, desc: str, ranks: list[int]) -> Callable[[], None]:
    def finish() -> None:
        watchdog.waiting_for(desc, ranks=ranks)
        wait()
        watchdog.progress()
    return finish


def attach_heartbeat(watchdog: Watchdog, mesh: Any, device: torch.device, info: Any = None,
                     stages_of: Callable[[int], list[int]] | None = None) -> None:
    """Publish this rank's beats through the process group's store and let the watchdog read everyone's (nothing
    for one process); on a GPU the beats carry the peak device memory, and device progress is probed. `info`
    (the launcher's `LaunchInfo`) says where the store is, for the line of a rank that cannot reach it;
    `stages_of(position)` gives a pipeline position's stages where ranks hold several."""
    if not dist.is_initialized() or mesh.world_size == 1:
        return
    store = own_connection(dist.distributed_c10d._get_default_store())  # never behind the main thread's calls
    watchdog.heartbeat = Heartbeat(store, mesh.rank, mesh.world_size, lambda r: describe_rank(r, mesh.pp, stages_of),
                                   host=host_of, store_at=describe_store(info, mesh.pp, stages_of),
                                   store_rank=None if _torchelastic_use_agent_store() else 0)
    if device.type == "cuda":
        watchdog.set_memory_probe(lambda: torch.cuda.max_memory_allocated(device) / 2**30)


def describe_rank(rank: int, pp: int, stages_of: Callable[[int], list[int]] | None = None) -> str:
    """'rank 3 (stage 1)', with the replica when there are several: 'rank 3 (stage 1, replica 1)', and its host
    when the job spans several: 'rank 3 (stage 1, replica 1, on node2)'; 'rank 1 (stages 1, 2)' where a rank
    holds several stages (`stages_of` its pipeline position's)."""
    host = host_of(rank)
    stages = stages_of(rank % pp) if stages_of else rank % pp
    return (f"rank {rank} ({stage_label(stages)}" + (f", replica {rank // pp}" if rank >= pp else "")
            + (f", on {host})" if host else ")"))


def describe_store(info: Any, pp: int, stages_of: Callable[[int], list[int]] | None = None) -> str:
    """'at 10.0.0.1:29500, hosted by rank 0 (stage 0, on node1)' (or by torchrun's agent there): where the
    rendezvous store is (env.py opens it) and which process keeps it up."""
    if info is None or not getattr(info, "master_addr", None):
        return ""
    by = "torchrun's agent there" if _torchelastic_use_agent_store() else describe_rank(0, pp, stages_of)
    return f"at {info.master_addr}:{info.master_port}, hosted by {by}"
