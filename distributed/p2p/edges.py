"""Which pipeline edges stay inside a host, and the transport of every edge of the job.

At start-up every rank tells every other (one `all_gather_object`) its host id, its pipeline neighbours, its GPU
and the GPUs that GPU can reach as a peer, and whether the copy engine can run here. From those facts every rank
computes the same plan for every edge (stage s -> s+1 of each replica):

  copy engine   both ends on one host, on two GPUs with peer access both ways, and every rank of the job able
                to run the copy engine (its construction and teardown are collective over the whole job)
  nccl / gloo   everything else: across hosts, without peer access, `--p2p nccl`, and on the CPU (gloo)

The host id is the host name; PEERLINE_HOST_ID overrides it, either one id for this process or a comma-separated
list indexed by the global rank ("a,a,b,b": ranks 0-1 on host a, 2-3 on host b), so tests can pretend that
ranks of one machine run on different hosts.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from peerline import overrides
from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import Links

COPY_ENGINE = "copy-engine"
#: edges named one by one in the start-up line; more are counted
SHOWN_EDGES = 8
#: every rank's host, learnt at start-up by gather_facts (one process, one job)
_job_hosts: dict[int, str] = {}


@dataclass(frozen=True)  # no slots: all_gather_object pickles it (frozen slotted dataclasses do not unpickle on 3.10)
class RankFacts:
    """What one rank tells the others at start-up."""

    rank: int
    host: str
    prev: int | None
    next: int | None
    device: int | None = None  # CUDA ordinal; None on the CPU
    peers: tuple[int, ...] = ()  # ordinals this rank's GPU reaches with peer access
    copy_engine: bool = False  # CuPy and cuda-bindings usable here


@dataclass(frozen=True, slots=True)
class Edge:
    """One pipeline edge: stage s on rank `src` to stage s+1 on rank `dst`, their hosts and its transport."""

    src: int
    dst: int
    src_host: str
    dst_host: str
    transport: str

    @property
    def same_host(self) -> bool:
        return self.src_host == self.dst_host

    def describe(self) -> str:
        where = self.src_host if self.same_host else f"{self.src_host} -> {self.dst_host}"
        return f"{self.src}-{self.dst} {self.transport} ({where})"


def host_id(rank: int) -> str:
    """This rank's host: PEERLINE_HOST_ID (one id, or a list indexed by the global rank), else the host name."""
    value = overrides.get("PEERLINE_HOST_ID")
    if value is None:
        return socket.gethostname()
    ids = [part.strip() for part in value.split(",")]
    if len(ids) == 1:
        return ids[0]
    if rank >= len(ids) or not ids[rank]:
        raise ConfigError(f"PEERLINE_HOST_ID={value!r} names {len(ids)} host(s), none for rank {rank}")
    return ids[rank]


def _gpu_facts(device: torch.device) -> tuple[int | None, tuple[int, ...], bool]:
    """(ordinal, peer ordinals, copy engine usable) of a CUDA device; (None, (), False) on the CPU."""
    if device.type != "cuda":
        return None, (), False
    index = torch.cuda.current_device() if device.index is None else device.index
    peers = tuple(j for j in range(torch.cuda.device_count())
                  if j != index and torch.cuda.can_device_access_peer(index, j))
    try:
        from peerline.distributed.p2p import flag_ops, ipc
    except ImportError:
        return index, peers, False
    return index, peers, ipc.available() and flag_ops.available()


def local_facts(links: Links, device: torch.device) -> RankFacts:
    """This rank's facts (rank 0 of a single process when no process group exists)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    index, peers, usable = _gpu_facts(device)
    return RankFacts(rank, host_id(rank), links.prev_rank, links.next_rank, index, peers, usable)


def gather_facts(mine: RankFacts) -> list[RankFacts]:
    """Every rank's facts, in rank order (collective over the default group; just ours without one). Also
    remembers every rank's host for failure lines (`host_of`)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    facts: list[RankFacts | None] = [None] * dist.get_world_size()
    dist.all_gather_object(facts, mine)
    found = sorted(facts, key=lambda f: f.rank)  # type: ignore[union-attr, arg-type]
    _job_hosts.clear()
    _job_hosts.update({f.rank: f.host for f in found})  # type: ignore[union-attr]
    return found  # type: ignore[return-value]


def host_of(rank: int) -> str | None:
    """The host of `rank` when the job spans several hosts (failure lines name the node that was lost), else
    None: on one host the host says nothing."""
    return _job_hosts.get(rank) if len(set(_job_hosts.values())) > 1 else None


def plan_edges(facts: list[RankFacts], choice: str, device_type: str) -> list[Edge]:
    """The transport of every edge of the job (the same list on every rank: it depends only on shared facts).

    choice is `--p2p`: 'auto' as in the module docstring; 'nccl' the collective everywhere; 'copy-engine' the
    copy engine everywhere, refused (ConfigError) where an edge crosses hosts."""
    by_rank = {f.rank: f for f in facts}
    collective = "nccl" if device_type == "cuda" else "gloo"
    job_copy_engine = device_type == "cuda" and choice != "nccl" and all(f.copy_engine for f in facts)
    edges = []
    for a in facts:
        if a.next is None or a.next not in by_rank:
            continue
        b = by_rank[a.next]
        same = a.host == b.host
        if choice == COPY_ENGINE and device_type == "cuda":
            if not same:
                raise ConfigError(f"--p2p copy-engine: ranks {a.rank} and {b.rank} run on different hosts "
                                  f"({a.host}, {b.host}); the copy engine works inside one host: use --p2p auto")
            kind = COPY_ENGINE
        else:
            peer_access = a.device != b.device and b.device in a.peers and a.device in b.peers
            kind = COPY_ENGINE if job_copy_engine and same and peer_access else collective
        edges.append(Edge(a.rank, b.rank, a.host, b.host, kind))
    return edges


def same_host_ranks(facts: list[RankFacts], rank: int) -> list[int]:
    """The ranks that share `rank`'s host (itself included)."""
    host = next(f.host for f in facts if f.rank == rank)
    return [f.rank for f in facts if f.host == host]


def neighbour_transports(edges: list[Edge], rank: int) -> dict[int, str]:
    """This rank's neighbours and the transport of the edge to each."""
    routes = {}
    for e in edges:
        if e.src == rank:
            routes[e.dst] = e.transport
        elif e.dst == rank:
            routes[e.src] = e.transport
    return routes


def describe_edges(edges: list[Edge]) -> str:
    """One line: the first SHOWN_EDGES edges with transport and hosts, then counts of the rest."""
    if not edges:
        return "p2p edges: none (one stage per pipeline)"
    shown = ", ".join(e.describe() for e in edges[:SHOWN_EDGES])
    hosts = len({e.src_host for e in edges} | {e.dst_host for e in edges})
    crossing = sum(not e.same_host for e in edges)
    rest = f", and {len(edges) - SHOWN_EDGES} more" if len(edges) > SHOWN_EDGES else ""
    return f"p2p edges over {hosts} host(s), {crossing} across hosts: {shown}{rest}"
