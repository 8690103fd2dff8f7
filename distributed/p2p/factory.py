"""Pick this rank's transport from `--p2p` and the hardware.

'auto' takes the copy engine when every peer is a GPU of this host with peer access, else NCCL (gloo on the CPU).
The copy-engine module is imported only when a GPU run may use it, so CPU runs never load CuPy.
"""

from __future__ import annotations

import logging

import torch

from peerline.distributed.config import P2P as P2P_CHOICES
from peerline.distributed.p2p.base import Links, Transport
from peerline.distributed.p2p.collective import CollectiveTransport
from peerline.distributed.streams import RankStreams

log = logging.getLogger(__name__)


def make_transport(choice: str, links: Links, device: torch.device, num_microbatches: int,
                   streams: RankStreams | None = None, **kwargs: object) -> Transport:
    """Pick the transport for this rank. 'auto': copy engine when the peers are GPUs of this host with peer
    access, else NCCL / gloo. Every rank of a pipeline must pick the same, so the choice depends only on facts
    all ranks share."""
    if choice not in P2P_CHOICES:
        raise ValueError(f"unknown --p2p {choice!r}; choose one of {', '.join(P2P_CHOICES)}")
    if device.type != "cuda" or choice == "nccl":
        return CollectiveTransport(links, device, num_microbatches)
    try:
        from peerline.distributed.p2p.copy_engine import CopyEngineTransport, copy_engine_usable
    except ImportError as exc:
        if choice == "copy-engine":
            raise
        log.info("copy-engine transport unavailable (%s); using NCCL", exc)
        return CollectiveTransport(links, device, num_microbatches)
    if choice == "copy-engine" or copy_engine_usable(links, device):
        return CopyEngineTransport(links, device, num_microbatches, streams=streams, **kwargs)
    return CollectiveTransport(links, device, num_microbatches)
