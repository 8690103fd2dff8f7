"""What a run with several stages per rank over several ranks (interleaved, zbv) needs beside the engine: the rank
programs, checked; this rank's links (the wrap-around edge included) with one message spec per channel; the route
of every message to its (channel, id); the ring depth the programs need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peerline.choices import DEFAULT_ZB_ORDER
from peerline.distributed.config import ConfigError
from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec
from peerline.distributed.pipeline import rank_sim
from peerline.distributed.pipeline.order_search import order_note, run_orders
from peerline.distributed.pipeline.placement import (
    MessageKey,
    Placement,
    ids_per_channel,
    message_keys,
    placement_for,
)
from peerline.distributed.pipeline.rank_schedule import Compute, RankProgram, stage_programs, with_rank_messages
from peerline.distributed.pipeline.schedule import ScheduleError, Step


@dataclass
class PlacedSchedule:
    """The rank programs of `schedule` on `placement` with M microbatches, in two forms: `programs` for a
    rendezvous transport (NCCL, gloo; checked against it, the strictest model, when built) and `ring_programs`
    for a ring transport (the copy engine: each receive just before its consumer, rank_schedule.with_rank_messages).
    A transport with a capacity runs the ring form where it plays with that capacity, else the rendezvous form."""

    schedule: str
    placement: Placement
    microbatches: int
    memory: str = "fast"  # --zb-memory (zbv)
    order: str = DEFAULT_ZB_ORDER  # --zb-order (zbv, zb-interleaved)
    orders: list[list[Compute]] = field(init=False)  # each rank's computes, the programs' order
    programs: list[RankProgram] = field(init=False)
    ring_programs: list[RankProgram] = field(init=False)
    keys: dict[MessageKey, tuple[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.orders = run_orders(self.schedule, self.placement, self.microbatches, self.memory, self.order)
        self.programs = with_rank_messages(self.orders, self.placement)
        rank_sim.simulate_ranks(self.programs, self.placement, self.microbatches, None)
        self.ring_programs = with_rank_messages(self.orders, self.placement, rendezvous=False)
        self.keys = message_keys(self.programs, self.placement)  # the sends, and so the keys, are the same in both

    @property
    def ids(self) -> int:
        """Message ids per channel: the receive buffers of a transport that never reuses one."""
        return ids_per_channel(self.keys)

    def stage_programs(self) -> list[list[Step]]:
        return stage_programs(self.programs, self.placement.n_stages)

    def programs_for(self, capacity: int | None) -> list[RankProgram]:
        """The form a transport of `capacity` runs (None: rendezvous), played against that capacity: the ring form
        where it plays, else the rendezvous form (ScheduleError with the table where that is stuck too)."""
        if capacity is not None:
            try:
                rank_sim.simulate_ranks(self.ring_programs, self.placement, self.microbatches, capacity)
                return self.ring_programs
            except ScheduleError:
                pass
        rank_sim.simulate_ranks(self.programs, self.placement, self.microbatches, capacity)
        return self.programs

    def program_of(self, position: int, capacity: int | None = None) -> list[tuple[int, Step]]:
        """Rank `position`'s share of the form a transport of `capacity` runs, played first (`programs_for`)."""
        return self.programs_for(capacity)[position]

    def route(self, kind: str, boundary: int, mb: int) -> tuple[str, int]:
        return self.keys[(kind, boundary, mb)]

    def order_note(self) -> str | None:
        """The start-up line of a run whose --zb-order is not list (order_search.order_note)."""
        return order_note(self.schedule, self.placement, self.microbatches, self.memory, self.order, self.orders)

    def min_capacity(self) -> int:
        """Fewest ring slots per channel the rendezvous form runs with (the copy engine's depth: a transport that
        mixes the copy engine with a rendezvous one runs that form). The ring form never needs more (its receives
        only come later); `programs_for` still plays it at the depth given before handing it out."""
        return rank_sim.min_rank_capacity(self.programs, self.placement, self.microbatches)

    def render(self) -> str:
        return rank_sim.rank_table(self.programs) + "\n" + LEGEND


LEGEND = ("legend: Fn@s / Bn@s / Wn@s forward / input gradient (the whole backward without W) / weight gradient of "
          "microbatch n on stage s;\n        SAn@s / RAn@s stage s sends its activation to stage s+1 / receives it "
          "from s-1;\n        SGn@s / RGn@s stage s sends its input gradient to s-1 / receives its output's from "
          "s+1; a+b posted together (the receives as a rendezvous transport posts them: the copy engine posts each\n"
          "        receive alone, just before the compute that reads it)")


def placed_links(ps: PlacedSchedule, position: int, prev_rank: int | None, next_rank: int | None,
                 in_specs: dict[int, object], out_specs: dict[int, object]) -> Links:
    """This rank's links: the mesh's neighbours (with the wrap-around edge) and the one message spec each channel
    carries. `in_specs` / `out_specs`: BoundarySpec of every local stage's input and output."""
    placement = ps.placement
    wanted: dict[str, set[TensorSpec]] = {ACT: set(), GRAD: set()}
    for s in placement.stages_of(position):
        if s > 0 and placement.remote(s - 1, s):
            wanted[placement.channel(ACT, s - 1)].add(in_specs[s].message)
        if s < placement.n_stages - 1 and placement.remote(s, s + 1):
            wanted[placement.channel(GRAD, s)].add(out_specs[s].grad_message)
    for specs in wanted.values():
        if len(specs) > 1:
            shown = ", ".join(f"{list(sp.shape)} {str(sp.dtype).removeprefix('torch.')}" for sp in specs)
            raise ConfigError(f"--schedule {ps.schedule}: the messages one rank receives from one neighbour must "
                              f"share a shape and dtype (they share a ring); stage boundaries give {shown}")
    one = {channel: next(iter(specs)) if specs else None for channel, specs in wanted.items()}
    return Links(prev_rank=prev_rank, next_rank=next_rank, act_in=one[ACT] if prev_rank is not None else None,
                 grad_in=one[GRAD] if next_rank is not None else None)


def placed_schedule(schedule: str, pp: int, per_rank: int, m: int, memory: str = "fast",
                    order: str = DEFAULT_ZB_ORDER) -> PlacedSchedule | None:
    """The checked rank programs of a schedule that places stages (interleaved, zbv); None for the others (one
    program per stage: pipeline/schedule.py). ConfigError for a grid the schedule cannot run. `memory`:
    --zb-memory; `order`: --zb-order."""
    placement = placement_for(schedule, pp, per_rank)
    return None if placement is None else PlacedSchedule(schedule, placement, m, memory, order)
