"""The collective transport: torch.distributed batched isend/irecv, NCCL on GPUs and gloo on the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from peerline.distributed.p2p.base import ACT, GRAD, Links, Transport


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

    def exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]]
                 ) -> list[torch.Tensor]:
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
