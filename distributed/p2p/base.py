"""The interface every stage-to-stage transport implements, and the data that describes a pipeline edge.

The engine speaks to one interface, `Transport`:

  exchange(sends, recvs)  post a group of sends and receives together and return the received tensors, ready
                          for use on the current (compute) stream. Sends and receives of one group are posted
                          at once, so two neighbours that send to each other in the same step cannot deadlock.
  release(kind, mb)       the consumer no longer reads what it received for (kind, mb): its buffer may be reused.

Message kinds: "act" travels stage s -> s+1, "grad" travels s+1 -> s. The implementations live beside this
module: collective.py (NCCL / gloo), copy_engine.py (CUDA IPC); factory.py picks one per rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

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
        """One line for the log: the transport's name and, where it has them, its edges and options."""
        return self.name
