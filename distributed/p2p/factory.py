"""Pick this rank's transport from `--p2p`, the hardware and where its neighbours run: one transport per edge.

Every rank learns every rank's host at start-up (edges.py) and plans every edge alike: 'auto' takes the copy
engine between GPUs of one host with peer access, NCCL across hosts (gloo on the CPU). A rank whose two edges
differ gets a `RoutedTransport` that sends each neighbour's messages through its edge's transport. The copy-engine
module is imported only when some edge of the job uses it, so CPU runs never load CuPy.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from peerline.distributed.config import P2P as P2P_CHOICES
from peerline.distributed.p2p.base import Links, Transport
from peerline.distributed.p2p.collective import CollectiveTransport
from peerline.distributed.p2p.edges import (
    COPY_ENGINE,
    Edge,
    gather_facts,
    local_facts,
    neighbour_transports,
    plan_edges,
)
from peerline.distributed.p2p.routed import RoutedTransport
from peerline.distributed.streams import RankStreams

log = logging.getLogger(__name__)


def make_transport(choice: str, links: Links, device: torch.device, num_microbatches: int,
                   streams: RankStreams | None = None, **kwargs: object) -> Transport:
    """This rank's transport (collective over every rank: see make_edge_transport)."""
    return make_edge_transport(choice, links, device, num_microbatches, streams, **kwargs)[0]


def make_edge_transport(choice: str, links: Links, device: torch.device, num_microbatches: int,
                        streams: RankStreams | None = None, **kwargs: object) -> tuple[Transport, list[Edge]]:
    """This rank's transport and the plan of every edge of the job. Collective: every rank exchanges its host
    and GPU facts, and builds the copy-engine transport whenever any edge of the job uses it (its construction
    and close are collective), with only its own copy-engine edges."""
    if choice not in P2P_CHOICES:
        raise ValueError(f"unknown --p2p {choice!r}; choose one of {', '.join(P2P_CHOICES)}")
    facts = local_facts(links, device)
    edges = plan_edges(gather_facts(facts), choice, device.type)
    mine = neighbour_transports(edges, facts.rank)
    parts: list[Transport] = []
    copy_engine = None
    if any(e.transport == COPY_ENGINE for e in edges):
        from peerline.distributed.p2p.copy_engine import CopyEngineTransport

        copy_engine = CopyEngineTransport(_only(links, mine, COPY_ENGINE), device, num_microbatches,
                                          streams=streams, **kwargs)
        parts.append(copy_engine)
    collective_peers = [peer for peer, kind in mine.items() if kind != COPY_ENGINE]
    collective = None
    if collective_peers or copy_engine is None:
        collective = CollectiveTransport(_only(links, mine, None), device, num_microbatches)
        parts.append(collective)
    if len(parts) == 1:
        return parts[0], edges
    routes = {peer: copy_engine if kind == COPY_ENGINE else collective for peer, kind in mine.items()}
    return RoutedTransport(links, routes, parts), edges


def _only(links: Links, mine: dict[int, str], kind: str | None) -> Links:
    """`links` without the neighbours whose edge does not use `kind` (None: every kind but the copy engine)."""
    def keep(peer: int | None) -> bool:
        return peer is not None and (mine.get(peer) == kind if kind else mine.get(peer, "") != COPY_ENGINE)

    prev, nxt = keep(links.prev_rank), keep(links.next_rank)
    return replace(links, prev_rank=links.prev_rank if prev else None, next_rank=links.next_rank if nxt else None,
                   act_in=links.act_in if prev else None, grad_in=links.grad_in if nxt else None)
