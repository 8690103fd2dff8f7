"""Which rank holds which pipeline stage, and over which channel of the rank's transport each message travels.

One stage per rank (gpipe, 1f1b, zb-h1) puts stage s on rank s. With V stages per rank two shapes exist:
  loop  (interleaved, zb-interleaved)  stage s on rank s % pp: rank r holds r, r+pp, ...; the last rank hands
                       stage r+pp-1's output round to the first rank (the wrap-around edge), so every rank has a
                       previous and a next rank.
  v     (zbv)          stage s on rank s for s < pp and on rank 2pp-1-s after: the first rank holds the first and
                       the last stage, the last rank two adjacent ones (no wrap-around edge).
A transport knows two channels per rank (p2p/base.py): ACT from the previous rank and to the next, GRAD the other
way. Here a channel is a direction in rank order: an activation of the V's second leg travels to the previous rank,
so it takes the GRAD channel. Several stage boundaries share a channel; a message's id on it is its place in the
channel's send order (`message_keys`), so both ends name it alike and a ring of K slots holds ids n and n+K in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import ACT, GRAD

LOOP, V_SHAPE = "loop", "v"


@dataclass(frozen=True, slots=True)
class Placement:
    """pp ranks holding `per_rank` stages each, placed in `shape` (LOOP or V_SHAPE)."""

    pp: int
    per_rank: int
    shape: str = LOOP

    def __post_init__(self) -> None:
        if self.shape == V_SHAPE and self.per_rank != 2:
            raise ConfigError(f"zbv places two stages per rank (a V): use --stages 2, not --stages {self.per_rank}")

    @property
    def n_stages(self) -> int:
        return self.pp * self.per_rank

    @property
    def wraps(self) -> bool:
        """Whether the last rank hands on to the first (interleaved stages over several ranks)."""
        return self.shape == LOOP and self.per_rank > 1 and self.pp > 1

    def rank_of(self, stage: int) -> int:
        """The pipeline position (rank within the replica) that holds `stage`."""
        if self.shape == V_SHAPE:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The global stages of pipeline position `rank`, in stage order."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    def remote(self, a: int, b: int) -> bool:
        return self.rank_of(a) != self.rank_of(b)

    def channel(self, kind: str, boundary: int) -> str:
        """The transport channel of a message of `kind` (ACT or GRAD) over boundary `boundary` -> `boundary`+1:
        ACT where the activation goes to the next rank, else GRAD (and the gradient the other way)."""
        downstream = self.shape == LOOP or boundary < self.pp - 1
        return kind if downstream else (GRAD if kind == ACT else ACT)


def placement_for(schedule: str, pp: int, per_rank: int) -> Placement | None:
    """The placement a schedule needs (None: the stage-per-program schedules, stages as streams when pp == 1)."""
    if schedule == "zbv":
        return Placement(pp, per_rank, V_SHAPE)
    if schedule in ("interleaved", "zb-interleaved"):
        return Placement(pp, per_rank, LOOP)
    if per_rank > 1 and pp > 1:
        raise ConfigError(f"--stages {per_rank} with pp={pp} places several stages on each rank: use --schedule "
                          f"interleaved, zb-interleaved or zbv (--schedule {schedule} runs several stages on one "
                          f"device only)")
    return None


MessageKey = tuple[str, int, int]  # (logical kind ACT / GRAD, boundary, microbatch)


def message_keys(rank_programs: list[list[tuple[int, tuple]]], placement: Placement
                 ) -> dict[MessageKey, tuple[str, int]]:
    """(kind, boundary, mb) of every message between two ranks -> (channel, id): ids count each (sender,
    channel) pair's sends in its program order, which every rank computes alike."""
    keys: dict[MessageKey, tuple[str, int]] = {}
    counts: dict[tuple[int, str], int] = {}
    for rank, program in enumerate(rank_programs):
        for stage, step in program:
            for a in step:
                if a.op not in ("SA", "SG"):
                    continue
                s = a.stage if a.stage >= 0 else stage
                kind, boundary, peer = (ACT, s, s + 1) if a.op == "SA" else (GRAD, s - 1, s - 1)
                if not placement.remote(s, peer):
                    continue
                channel = placement.channel(kind, boundary)
                n = counts.get((rank, channel), 0)
                counts[(rank, channel)] = n + 1
                keys[(kind, boundary, a.mb)] = (channel, n)
    return keys


def ids_per_channel(keys: dict[MessageKey, tuple[str, int]]) -> int:
    """The most ids any channel uses (the receive buffers each transport end needs without reuse)."""
    return 1 + max((i for _, i in keys.values()), default=0)
