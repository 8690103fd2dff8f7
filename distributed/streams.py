"""Every stream of a rank is created here, once, with its role named.

Roles (see ARCHITECTURE.md, "Stream roles of one rank"):
  compute    forward/backward kernels of this rank's stage(s)
  p2p        copies to / from the neighbouring stage (copy engine or NCCL); `p2p_lanes` holds extra send streams
             of the copy-engine transport (lanes 2..N: round robin or split copies, p2p/copy_engine.py)
  allreduce  bucketed gradient all-reduce; the highest priority the device allows, so a ready bucket is not
             queued behind backward kernels
  h2d / d2h  input staging from pinned host memory and results back

All CUDA streams are non-blocking (cudaStreamNonBlocking): nothing ever runs on the legacy default stream. On the
CPU every role is None and `use(stream)` is a no-op context, so the same engine code runs under gloo.

Hardware queues. A stream waiting on a flag (cuStreamWaitValue32, the copy-engine transport) blocks the hardware
queue (connection) it is mapped to, and with it every other stream on that queue. The driver maps streams onto
CUDA_DEVICE_MAX_CONNECTIONS queues (default 8) round robin in creation order. torch's stream pool is created in one
go, priorities interleaved (stream i of priority p is created (i * priorities + p)-th), so its low-priority streams
land on only a couple of queues: a compute stream and a p2p stream drawn from it can share one, and a wait on one
then stalls the other (a stream waiting for a write that the other stream would make never sees it: a hang). So
peerline creates its own streams here, one after the other (consecutive creations get different queues), wraps
them as torch.cuda.ExternalStream, and asks for 32 queues (the most there are) unless the user set a value before
CUDA starts. Without cuda-bindings it falls back to torch's pool with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from peerline import overrides
from peerline.distributed.config import ALLREDUCE_PRIORITIES

log = logging.getLogger(__name__)

#: hardware queues asked for (read by the driver when the CUDA context is created: importing this module early,
#: as every peerline entry point does, is enough); a value the user set is kept
HARDWARE_QUEUES = 32
overrides.set_default("CUDA_DEVICE_MAX_CONNECTIONS", str(HARDWARE_QUEUES))


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


def create_rank_streams(device: torch.device, local_stages: int = 1, p2p_lanes: int = 1,
                        allreduce_priority: str = "highest") -> RankStreams:
    """Create the streams of one rank. The only place in peerline that constructs a stream. p2p_lanes: send
    streams of the copy-engine transport in all (`p2p` plus p2p_lanes - 1 in `p2p_lanes`). allreduce_priority:
    "highest" (the device's highest) or "normal" (RunConfig.allreduce_priority says when each pays)."""
    if allreduce_priority not in ALLREDUCE_PRIORITIES:
        raise ValueError(f"allreduce_priority must be highest or normal, got {allreduce_priority!r}")
    if p2p_lanes < 1:
        raise ValueError(f"p2p_lanes must be >= 1, got {p2p_lanes}")
    if device.type != "cuda":
        return RankStreams(device=device, stage_compute=[None] * local_stages)
    # priority_range() is (lowest, highest); on CUDA a numerically smaller value is a higher priority.
    _, highest = torch.cuda.Stream.priority_range()
    with torch.cuda.device(device):
        return RankStreams(
            device=device,
            stage_compute=[new_stream(device) for _ in range(local_stages)],
            p2p=new_stream(device),
            p2p_lanes=[new_stream(device) for _ in range(p2p_lanes - 1)],
            allreduce=new_stream(device, priority=highest if allreduce_priority == "highest" else 0),
            h2d=new_stream(device),
            d2h=new_stream(device),
        )


_CUDA_STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking (ABI constant of cuda_runtime_api.h)
_pool_reason: str | None = None  # why streams come from torch's pool, once that happened


def new_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A fresh non-blocking CUDA stream of its own (not torch's pool; see the module docstring), as a torch
    stream. Lives until the process ends (ExternalStream never destroys it; a rank creates its streams once).
    Falls back to torch's pool, with one warning, if cuda-bindings is missing or the call fails."""
    global _pool_reason
    if _pool_reason is None:
        try:
            from cuda.bindings import runtime as cudart

            with torch.cuda.device(device):
                torch.cuda.init()
                err, handle = cudart.cudaStreamCreateWithPriority(_CUDA_STREAM_NON_BLOCKING, priority)
            if int(err) == 0:
                return torch.cuda.ExternalStream(int(handle), device=device)
            _pool_reason = f"cudaStreamCreateWithPriority returned {err}"
        except Exception as exc:  # noqa: BLE001 - any failure here means: use torch's pool, and say so
            _pool_reason = f"{type(exc).__name__}: {exc}"
        log.warning("peerline streams come from torch's pool (%s): a stream waiting on a flag may stall another "
                    "stream that shares its hardware queue", _pool_reason)
    return torch.cuda.Stream(device=device, priority=priority)


def own_streams() -> bool:
    """Whether streams are peerline's own (False once new_stream fell back to torch's pool)."""
    return _pool_reason is None


#: `use(None)`: one shared no-op context (reentrant), not a generator made and run per call
_NO_STREAM = contextlib.nullcontext()


def use(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """`torch.cuda.stream(stream)` on a GPU, nothing on the CPU."""
    return _NO_STREAM if stream is None else _use_cuda(stream)


@contextlib.contextmanager
def _use_cuda(stream: torch.cuda.Stream) -> Iterator[None]:
    with torch.cuda.stream(stream):
        yield


def wait_stream(waiter: torch.cuda.Stream | None, producer: torch.cuda.Stream | None) -> None:
    """Order `waiter` after the work already queued on `producer` (an event, never a host sync)."""
    if waiter is not None and producer is not None and waiter != producer:
        waiter.wait_stream(producer)
