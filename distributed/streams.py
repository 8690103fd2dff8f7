"""Every stream of a rank is created here, once, with its role named.

Roles (see ARCHITECTURE.md, "Stream roles of one rank"):
  compute    forward/backward kernels of this rank's stage(s)
  p2p        copies to / from the neighbouring stage (copy engine or NCCL); `p2p_lanes` holds extra send streams
             of the copy-engine transport (lanes 2..N: round robin or split copies, p2p_copy_engine.py)
  allreduce  bucketed gradient all-reduce; the highest priority the device allows, so a ready bucket is not
             queued behind backward kernels
  h2d / d2h  input staging from pinned host memory and results back

All CUDA streams are non-blocking (torch creates its streams with cudaStreamNonBlocking): nothing ever runs on
the legacy default stream. On the CPU every role is None and `use(stream)` is a no-op context, so the same engine
code runs under gloo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class RankStreams:
    """The named streams of one rank. `stage_compute` holds one compute stream per local stage (single-GPU mode
    runs several stages on one device, each on its own stream); `compute` is the first of them."""

    device: torch.device
    stage_compute: list[torch.cuda.Stream | None] = field(default_factory=list)
    p2p: torch.cuda.Stream | None = None
    p2p_lanes: list[torch.cuda.Stream] = field(default_factory=list)  # extra copy-engine send lanes beside p2p
    allreduce: torch.cuda.Stream | None = None
    h2d: torch.cuda.Stream | None = None
    d2h: torch.cuda.Stream | None = None

    @property
    def compute(self) -> torch.cuda.Stream | None:
        return self.stage_compute[0] if self.stage_compute else None

    def roles(self) -> dict[str, torch.cuda.Stream | None]:
        """Role name -> stream, for logs and timelines."""
        named = {f"compute{i}" if len(self.stage_compute) > 1 else "compute": s for i, s in
                 enumerate(self.stage_compute)}
        named.update(p2p=self.p2p)
        named.update({f"p2p{i + 2}": s for i, s in enumerate(self.p2p_lanes)})
        named.update(allreduce=self.allreduce, h2d=self.h2d, d2h=self.d2h)
        return named


def create_rank_streams(device: torch.device, local_stages: int = 1, p2p_lanes: int = 1) -> RankStreams:
    """Create the streams of one rank. The only place in peerline that constructs a stream. p2p_lanes: send
    streams of the copy-engine transport in all (`p2p` plus p2p_lanes - 1 in `p2p_lanes`)."""
    if p2p_lanes < 1:
        raise ValueError(f"p2p_lanes must be >= 1, got {p2p_lanes}")
    if device.type != "cuda":
        return RankStreams(device=device, stage_compute=[None] * local_stages)
    # priority_range() is (lowest, highest); on CUDA a numerically smaller value is a higher priority.
    _, highest = torch.cuda.Stream.priority_range()
    with torch.cuda.device(device):
        return RankStreams(
            device=device,
            stage_compute=[torch.cuda.Stream(device=device) for _ in range(local_stages)],
            p2p=torch.cuda.Stream(device=device),
            p2p_lanes=[torch.cuda.Stream(device=device) for _ in range(p2p_lanes - 1)],
            allreduce=torch.cuda.Stream(device=device, priority=highest),
            h2d=torch.cuda.Stream(device=device),
            d2h=torch.cuda.Stream(device=device),
        )


@contextlib.contextmanager
def use(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """`torch.cuda.stream(stream)` on a GPU, nothing on the CPU."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def wait_stream(waiter: torch.cuda.Stream | None, producer: torch.cuda.Stream | None) -> None:
    """Order `waiter` after the work already queued on `producer` (an event, never a host sync)."""
    if waiter is not None and producer is not None and waiter != producer:
        waiter.wait_stream(producer)
