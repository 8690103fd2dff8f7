"""A rank whose two edges use different transports: each neighbour's messages go through its edge's transport.

A middle stage may hand activations to a GPU of its own host over the copy engine and to the next host over NCCL
(edges.py decides). `RoutedTransport` holds both and routes every send, receive and release by the peer rank.
One exchange group is issued as: the buffered transports' sends (copy engine: queued on p2p lanes, they wait for
the producer only), then the rendezvous transports' sends and receives together (NCCL / gloo: posted as one
batch, so two neighbours sending to each other cannot deadlock), then the buffered transports' receives (waits on
the current stream). Nothing waits on more than the group as a whole would under one collective batch.
"""

from __future__ import annotations

import torch

from peerline.distributed.p2p.base import Links, Transport


class RoutedTransport(Transport):
    """`routes`: peer rank -> transport of that edge. `parts`: every transport this rank built, in the order they
    close (the same on every rank: a copy-engine transport's close is collective over the job)."""

    def __init__(self, links: Links, routes: dict[int, Transport], parts: list[Transport]) -> None:
        self.links, self.routes, self.parts = links, routes, parts
        used = [p for p in parts if any(t is p for t in routes.values())]
        self.name = "+".join(p.name for p in used) or (parts[0].name if parts else "none")
        caps = [p.capacity for p in used]
        # The schedule validator gets the strictest model: rendezvous if any edge is one, else the smallest ring.
        self.capacity = None if not caps or any(c is None for c in caps) else min(caps)

    def _by_part(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]]
                 ) -> dict[int, tuple[Transport, list, list[int]]]:
        """id(part) -> (part, its sends, indices of its receives in `recvs`), in `parts` order."""
        grouped: dict[int, tuple[Transport, list, list[int]]] = {}
        for p in self.parts:
            grouped[id(p)] = (p, [], [])
        for item in sends:
            grouped[id(self.routes[self.links.peer(item[0], sending=True)])][1].append(item)
        for i, (kind, _mb) in enumerate(recvs):
            grouped[id(self.routes[self.links.peer(kind, sending=False)])][2].append(i)
        return {k: v for k, v in grouped.items() if v[1] or v[2]}

    def exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]]
                 ) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(recvs)
        groups = list(self._by_part(sends, recvs).values())
        buffered = [g for g in groups if g[0].capacity is not None]
        for part, part_sends, _ in buffered:
            if part_sends:
                part.exchange(part_sends, [])
        for part, part_sends, idx in groups:
            if part.capacity is None:
                for i, t in zip(idx, part.exchange(part_sends, [recvs[i] for i in idx])):
                    out[i] = t
        for part, _, idx in buffered:
            if idx:
                for i, t in zip(idx, part.exchange([], [recvs[i] for i in idx])):
                    out[i] = t
        return out  # type: ignore[return-value]

    def release(self, kind: str, mb: int) -> None:
        self.routes[self.links.peer(kind, sending=False)].release(kind, mb)

    def finish_iteration(self) -> None:
        for p in self.parts:
            p.finish_iteration()

    def reset(self, flags: bool = False) -> None:
        """Forget host bookkeeping in every part that keeps some (see CopyEngineTransport.reset)."""
        for p in self.parts:
            reset = getattr(p, "reset", None)
            if reset is not None:
                reset(flags=flags)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def describe(self) -> str:
        edges = ", ".join(f"{peer}: {t.name}" for peer, t in sorted(self.routes.items()))
        return f"{self.name} ({edges})"
