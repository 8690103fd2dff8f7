"""Transports that hand activations (forward) and gradients (backward) between neighbouring stages.

The engine speaks to one interface, `Transport`:

  exchange(sends, recvs)  post a group of sends and receives together and return the received tensors, ready
                          for use on the current (compute) stream. Sends and receives of one group are posted
                          at once, so two neighbours that send to each other in the same step cannot deadlock.
  release(kind, mb)       the consumer no longer reads what it received for (kind, mb): its buffer may be reused.

Message kinds: "act" travels stage s -> s+1, "grad" travels s+1 -> s.

`CollectiveTransport` (here) uses torch.distributed batched isend/irecv: NCCL on GPUs, gloo on the CPU.
The copy-engine transport (p2p_copy_engine.py) writes straight into the neighbour's memory over CUDA IPC.
`make_transport` picks one per rank from `--p2p` and the hardware.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ACT, GRAD = "act", "grad"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one message (one microbatch's activation or gradient)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class Links:
    """Who this rank talks to: global ranks of the previous / next stage of its pipeline (None at the ends), and
    the specs of what it receives from each (activations from prev, gradients from next)."""

    prev_rank: int | None
    next_rank: int | None
    act_in: TensorSpec | None  # activation received from prev
    grad_in: TensorSpec | None  # gradient received from next (shape of this stage's output)

    def peer(self, kind: str, sending: bool) -> int:
        """Global rank at the other end of a message of `kind` that this rank sends (or receives)."""
        forward = (kind == ACT) == sending
        rank = self.next_rank if forward else self.prev_rank
        if rank is None:
            raise ValueError(f"stage has no peer for {'sending' if sending else 'receiving'} {kind}")
        return rank

    def peer_or_none(self, kind: str) -> int | None:
        """Global rank this stage receives `kind` from, or None at the pipeline's end."""
        return self.prev_rank if kind == ACT else self.next_rank


class Transport(ABC):
    """One rank's end of its pipeline edges."""

    name: str = "abstract"
    #: messages of one kind that may be in flight before a send must wait for the receiver; None = rendezvous
    #: (a send completes only with its matching receive). The schedule validator simulates with this.
    capacity: int | None = None

    @abstractmethod
    def exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]]
                 ) -> list[torch.Tensor]:
        """Post `sends` [(kind, mb, tensor)] and `recvs` [(kind, mb)] as one group; return received tensors."""

    def release(self, kind: str, mb: int) -> None:  # noqa: B027 - optional hook
        """The consumer is done with the tensor received for (kind, mb)."""

    def finish_iteration(self) -> None:  # noqa: B027 - optional hook
        """Join work this transport queued on side streams into the current stream (end of an iteration, so a
        CUDA-graph capture that forked onto those streams joins back)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free buffers and handles."""

    def describe(self) -> str:
        return self.name


class CollectiveTransport(Transport):
    """torch.distributed batched isend/irecv (NCCL on GPUs, gloo on CPU) into per-microbatch receive buffers.

    The buffers are allocated once, so a captured CUDA graph sees the same addresses on every replay.
    """

    capacity = None

    def __init__(self, links: Links, device: torch.device, num_microbatches: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.links = links
        self.group = group
        self.name = "nccl" if device.type == "cuda" else "gloo"
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        for kind, spec in ((ACT, links.act_in), (GRAD, links.grad_in)):
            if spec is None or links.peer_or_none(kind) is None:
                continue
            for mb in range(num_microbatches):
                self._buffers[(kind, mb)] = torch.empty(spec.shape, dtype=spec.dtype, device=device)

    def exchange(self, sends, recvs):
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.links.peer(kind, sending=True), self.group)
               for kind, _mb, t in sends]
        out = [self._buffers[(kind, mb)] for kind, mb in recvs]
        ops += [dist.P2POp(dist.irecv, buf, self.links.peer(kind, sending=False), self.group)
                for (kind, _mb), buf in zip(recvs, out)]
        if ops:
            # On NCCL, wait() only orders the current stream after the transfer: no host sync.
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return out


P2P_CHOICES = ("auto", "copy-engine", "nccl")


def make_transport(choice: str, links: Links, device: torch.device, num_microbatches: int,
                   streams=None, **kwargs) -> Transport:
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
