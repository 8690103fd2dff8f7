"""The pp x dp grid of ranks: stages, replicas, process groups and neighbours.

Layout: replicas of whole pipelines, rank = replica * pp + stage, so a pipeline's stages sit on consecutive ranks
(consecutive GPUs of a node, the best-connected pairs) and a data-parallel group holds one stage of every replica.
`stage` here is the rank's position in its pipeline; with several stages per rank (pipeline/placement.py) the
position holds several global stages, and the interleaved placement adds the wrap-around edge: the last position's
next rank is the first's (`wrap`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from peerline.distributed.config import ConfigError


@dataclass(slots=True)
class Mesh:
    """The grid, checked at construction: pp * dp must equal the world size."""

    pp: int
    dp: int
    rank: int
    wrap: bool = False  # the last position hands on to the first (interleaved stages over several ranks)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # the same ranks as dp_group with the backend's default options, when dp_group has options (a CTA cap): the
    # buckets backward finishes last have nothing left to overlap with and all-reduce there at full speed
    dp_tail_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # {first stage, last stage} of this rank's replica (pp > 1, tied embeddings): the tied weights' gradient sum
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1:
            raise ConfigError(f"grid must be positive: pp={self.pp}, dp={self.dp}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside a grid of pp={self.pp} x dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.pp + stage

    @property
    def prev_rank(self) -> int | None:
        if self.stage > 0 or (self.wrap and self.pp > 1):
            return self.rank_of((self.stage - 1) % self.pp, self.replica)
        return None

    @property
    def next_rank(self) -> int | None:
        if self.stage < self.pp - 1 or (self.wrap and self.pp > 1):
            return self.rank_of((self.stage + 1) % self.pp, self.replica)
        return None

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, r) for r in range(self.dp)]

    def pp_ranks(self, replica: int) -> list[int]:
        return [self.rank_of(s, replica) for s in range(self.pp)]

    def embedding_ranks(self, replica: int) -> list[int]:
        """The ranks holding a replica's first and last stage (one rank when pp == 1)."""
        return sorted({self.rank_of(0, replica), self.rank_of(self.pp - 1, replica)})

    def create_embedding_groups(self) -> None:
        """One group per replica of its first and last stage's ranks (Megatron-LM's embedding group), for the
        gradient sum of weights tied across them. Collective over the world like create_groups; none when pp == 1
        (both stages on one rank: the sum is local)."""
        if not dist.is_initialized() or self.pp == 1:
            return
        for replica in range(self.dp):
            group = dist.new_group(self.embedding_ranks(replica))
            if replica == self.replica:
                self.embedding_group = group

    def create_groups(self, dp_options: Any = None) -> None:
        """Create every dp group (and its uncapped tail twin when `dp_options` is given). new_group is collective
        over the world: every rank creates every group, in the same order, and keeps its own. `dp_options`: backend
        options of the dp groups (buckets.nccl_options: a cap on NCCL's CTAs), None for the defaults. Pipeline
        neighbours talk over the default group (the transports name global ranks), so there is no pp group."""
        if not dist.is_initialized() or self.world_size == 1:
            return
        for stage in range(self.pp):
            group = dist.new_group(self.dp_ranks(stage), pg_options=dp_options)
            if stage == self.stage:
                self.dp_group = group
            if dp_options is not None:
                tail = dist.new_group(self.dp_ranks(stage))
                if stage == self.stage:
                    self.dp_tail_group = tail

    def describe(self) -> str:
        return (f"rank {self.rank}: stage {self.stage}/{self.pp}, replica {self.replica}/{self.dp}, "
                f"prev {self.prev_rank}, next {self.next_rank}")
