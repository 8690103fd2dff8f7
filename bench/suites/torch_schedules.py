"""torch.distributed.pipelining's schedules as the anchor's candidates, shared by the pipeline and gpt suites: which
schedules there are, where each places its stages, which apply to a shape, the precision recipes, and the search
that measures every candidate (schedule, recipe[, blocks]) and keeps the fastest (what a user tuning torch would pick).

  pairs = candidates(wanted, recipes_for(dtype), pp, layers, M, dp, ctx.note)   # those that apply; the rest noted
  measured, best = fastest(ctx, "compute-bound torch", pairs, measure, failures)   # measure(schedule, recipe)
  triples = with_blocks(pairs, ["eager", "compiled"], ctx.note)   # the gpt suite: each block eager or compiled
  measured, best = fastest(ctx, ..., triples, measure, failures, axes=AXES_WITH_BLOCKS)

Schedules (TORCH_SCHEDULES): 1F1B and GPipe hold one stage per rank; Interleaved1F1B and InterleavedZeroBubble two
per rank in a loop (rank r: stages r and r + pp); ZBVZeroBubble and DualPipeV two per rank in a V (rank r: stages r
and 2 pp - 1 - r). A schedule that this torch lacks, or whose conditions the shape breaks (too few layers for its
stages, microbatches that do not fill its rounds, DDP over several stages per rank), is not tried and says why.
Recipes: bf16-params (modules cast to bf16: parameters, activations, optimizer state; what torch users run for
speed), autocast (fp32 parameters under bf16 autocast: peerline's numerics), fp32 (the fp32 shapes).
Blocks (BLOCKS): eager, or compiled (each transformer block under torch.compile, as torchtitan runs them). The
zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split the backward into input and weight
passes, which torch does not support through compiled modules (it refuses them: pytorch/pytorch#161904); their
compiled candidates are not tried, and say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peerline.bench.benchkit import Timing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TorchSchedule:
    """One torch.distributed.pipelining schedule: its class, stages per rank and their placement."""

    cls_name: str
    per_rank: int
    style: str  # "loop": rank r holds r, r + pp, ...; "v": rank r holds r and 2 pp - 1 - r
    splits_backward: bool = False  # input and weight gradients in separate passes (no compiled modules)


TORCH_SCHEDULES = {
    "1f1b": TorchSchedule("Schedule1F1B", 1, "loop"),
    "gpipe": TorchSchedule("ScheduleGPipe", 1, "loop"),
    "interleaved-1f1b": TorchSchedule("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": TorchSchedule("ScheduleInterleavedZeroBubble", 2, "loop", splits_backward=True),
    "zbv": TorchSchedule("ScheduleZBVZeroBubble", 2, "v", splits_backward=True),
    "dualpipev": TorchSchedule("ScheduleDualPipeV", 2, "v", splits_backward=True),
}
RECIPES = ("bf16-params", "autocast", "fp32")
BLOCKS = ("eager", "compiled")
#: the names of a candidate's parts, in order: (schedule, recipe), or (schedule, recipe, blocks)
AXES = ("schedule", "recipe")
AXES_WITH_BLOCKS = ("schedule", "recipe", "blocks")


def recipes_for(dtype: str) -> list[str]:
    """The precision recipes tried for a shape: both bf16 recipes, or fp32 alone."""
    return ["bf16-params", "autocast"] if dtype == "bf16" else ["fp32"]


def param_dtype(recipe: str) -> torch.dtype:
    return torch.bfloat16 if recipe == "bf16-params" else torch.float32


def stage_ids(schedule: str, rank: int, pp: int) -> list[int]:
    """The global stages pipeline rank `rank` holds under `schedule` (of pp x per_rank stages)."""
    spec = TORCH_SCHEDULES[schedule]
    if spec.per_rank == 1:
        return [rank]
    if spec.style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(spec.per_rank)]


def schedule_class(schedule: str) -> type | None:
    """The torch class of `schedule`, None when this torch lacks it."""
    from torch.distributed import pipelining

    return getattr(pipelining, TORCH_SCHEDULES[schedule].cls_name, None)


def why_not(schedule: str, pp: int, layers: int, microbatches: int, dp: int = 1) -> str | None:
    """Why `schedule` cannot run `layers` layers in M microbatches on pp pipeline ranks x dp, or None."""
    spec = TORCH_SCHEDULES[schedule]
    n_stages = pp * spec.per_rank
    if schedule_class(schedule) is None:
        return f"this torch ({torch.__version__}) has no {spec.cls_name}"
    if spec.per_rank > 1 and pp < 2:
        return "needs 2 or more pipeline ranks"
    if spec.per_rank > 1 and dp > 1:
        return "DDP over several stages per rank is not set up in this anchor"
    if layers < n_stages:
        return f"{layers} layers are too few for {n_stages} stages"
    if schedule == "1f1b" and microbatches < pp:
        return f"M={microbatches} is fewer than the {pp} stages"
    if schedule == "dualpipev" and microbatches < n_stages:
        return f"M={microbatches} is fewer than its {n_stages} stages"
    if schedule.startswith("interleaved"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return f"M={microbatches} is not a multiple of its {rounds} rounds (M // pp)"
    return None


def build_schedule(schedule: str, stages: list[Any], microbatches: int, loss_fn: Callable) -> Any:
    """The torch schedule object over this rank's PipelineStages (one, or the rank's several in stage_ids order)."""
    cls = schedule_class(schedule)
    return cls(stages if TORCH_SCHEDULES[schedule].per_rank > 1 else stages[0], microbatches, loss_fn=loss_fn)


def candidates(wanted: list[str] | None, recipes: list[str], pp: int, layers: int, microbatches: int, dp: int,
               note: Callable[[str], None], what: str = "anchor") -> list[tuple[str, str]]:
    """(schedule, recipe) pairs to try, schedules in TORCH_SCHEDULES order (`wanted` None: all); unknown names
    raise, schedules that do not apply are noted with the reason."""
    names = wanted or list(TORCH_SCHEDULES)
    unknown = [s for s in names if s not in TORCH_SCHEDULES]
    if unknown:
        raise ValueError(f"{what}: unknown torch schedule {unknown[0]!r}; choose from {', '.join(TORCH_SCHEDULES)}")
    bad_recipes = [r for r in recipes if r not in RECIPES]
    if bad_recipes:
        raise ValueError(f"{what}: unknown precision recipe {bad_recipes[0]!r}; choose from {', '.join(RECIPES)}")
    pairs = []
    for schedule in [s for s in TORCH_SCHEDULES if s in names]:
        why = why_not(schedule, pp, layers, microbatches, dp)
        if why:
            note(f"{what}: torch {TORCH_SCHEDULES[schedule].cls_name} not tried: {why}")
            continue
        pairs += [(schedule, r) for r in recipes]
    return pairs


def with_blocks(pairs: list[tuple[str, str]], blocks: list[str], note: Callable[[str], None],
                what: str = "anchor") -> list[tuple[str, str, str]]:
    """Each (schedule, recipe) with each of `blocks` (eager, compiled); a schedule that splits the backward gets no
    compiled candidate, noted once."""
    unknown = [b for b in blocks if b not in BLOCKS]
    if unknown:
        raise ValueError(f"{what}: unknown blocks {unknown[0]!r}; choose from {', '.join(BLOCKS)}")
    triples, refused = [], []
    for schedule, recipe in pairs:
        for b in blocks:
            if b == "compiled" and TORCH_SCHEDULES[schedule].splits_backward:
                if schedule not in refused:
                    refused.append(schedule)
                continue
            triples.append((schedule, recipe, b))
    for schedule in refused:
        note(f"{what}: torch {TORCH_SCHEDULES[schedule].cls_name} with compiled blocks not tried: it splits the "
             "backward into input and weight passes, which torch does not run through compiled modules")
    return triples


def fastest(ctx: Any, what: str, pairs: list[tuple[str, ...]], measure: Callable[..., Any], failures: list[str],
            axes: tuple[str, ...] = AXES) -> tuple[dict[str, Any], Any | None]:
    """Measure every candidate (`measure(*candidate)`, e.g. measure(schedule, recipe), -> a runtime_timing.Measured)
    on a freed device; returns ({"schedule recipe": Measured}, the fastest or None). Each Measured's extra names its
    parts by `axes` ("schedule", "recipe"[, "blocks"]); the fastest's also lists every candidate's time, first
    losses and peak memory ("candidates"). A failing candidate is logged and added to `failures`; the others still
    run. Every rank measures the same candidates, and the times are the slowest rank's, so every rank picks the
    same one."""
    from peerline.bench.runtime_timing import free_device

    measured: dict[str, Any] = {}
    for candidate in pairs:
        name = " ".join(candidate)
        ctx.step(f"{what} {name}")
        free_device(ctx.device)
        try:
            got = measure(*candidate)
        except Exception as exc:  # noqa: BLE001 - one candidate failing leaves the others
            log.exception("%s %s failed", what, name)
            failures.append(f"{what} {name}: {type(exc).__name__}: {exc}")
            continue
        finally:
            free_device(ctx.device)
        got.extra.update(zip(axes, candidate, strict=True))
        measured[name] = got
    if not measured:
        return measured, None
    best = min(measured.values(), key=lambda m: m.timing.median_ms)
    best.extra["candidates"] = {name: {"ms_per_iter": m.timing.median_ms, "host_lead_ms": m.timing.host_lead_ms,
                                       "losses": m.losses, "peak_mem_gb_per_rank": m.peak_gb_per_rank}
                                for name, m in measured.items()}
    return measured, best


def describe_candidates(measured: dict[str, Any], best: Any) -> str:
    """'1f1b fp32 3.21 (host lead 0.4 ms); gpipe fp32 3.40 (...); fastest: 1f1b fp32' (ms per iteration; the host
    lead, where measured, is the device work left when the host had issued a timed block: near 0, the candidate
    waits for its host and its time follows the host's speed)."""
    return f"{candidate_times(measured)}; fastest: {candidate_name(measured, best)}"


def candidate_times(measured: dict[str, Any]) -> str:
    """'1f1b fp32 3.21 (host lead 0.4 ms); gpipe fp32 3.40 (...)': each candidate's ms per iteration."""
    return "; ".join(f"{name} {m.timing.median_ms:.2f}" + host_lead(m.timing) for name, m in measured.items())


def host_lead(timing: Timing) -> str:
    """' (host lead 0.4 ms)' where the timing measured it (benchkit.time_blocks), else ''."""
    return "" if timing.host_lead_ms is None else f" (host lead {timing.host_lead_ms:.1f} ms)"


def candidate_name(measured: dict[str, Any], best: Any) -> str:
    """The name under which `best` was measured ('1f1b bf16-params compiled')."""
    return next(name for name, m in measured.items() if m is best)


__all__ = ["TORCH_SCHEDULES", "RECIPES", "BLOCKS", "AXES", "AXES_WITH_BLOCKS", "TorchSchedule", "recipes_for",
           "param_dtype", "stage_ids", "schedule_class", "why_not", "build_schedule", "candidates", "with_blocks",
           "fastest", "describe_candidates", "candidate_times", "host_lead", "candidate_name"]
