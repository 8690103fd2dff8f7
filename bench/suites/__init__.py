"""peerline.bench.suites: the benchmark suites of peerline-bench (launch/bench.py), by name.

Each suite module exposes `run(args, ctx)` (see bench/benchkit.py) and may expose `add_arguments(group)` for its
own flags and `skip_reason(args, ctx) -> str | None` for what this machine lacks (CUDA, an optional package).
The rank counts a suite needs are in MIN_RANKS / MAX_RANKS. Modules are imported only when asked for, so a suite
whose module is missing, or cannot import on this machine, is reported as not available.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: suite name -> module under peerline.bench.suites, in the order `all` runs them
SUITES: dict[str, str] = {
    "kernels": "kernels",
    "hostcost": "hostcost",
    "p2p": "p2p",
    "allreduce": "allreduce",
    "batch_streams": "batch_streams",
    "graph": "graph",
    "single": "single",
    "pipeline": "pipeline",
    "gpt": "gpt",
    "eager": "eager",
    "optimizer": "optimizer",
    "checkpoint": "checkpoint",
}

#: suite name -> what it measures (the `--help` list)
DESCRIPTIONS: dict[str, str] = {
    "kernels": "fused elementwise kernels vs torch eager",
    "hostcost": "host time per kernel launch and per engine action, eager, vs torch's (1 or 2 ranks)",
    "p2p": "copy-engine handoff vs NCCL send/recv (2 GPUs)",
    "allreduce": "bucketed all-reduce overlapped with backward vs DDP (2+ ranks)",
    "batch_streams": "multi-stream batch driver: N streams vs one (CUDA)",
    "graph": "whole-iteration CUDA graph vs eager and a hand-captured torch graph",
    "single": "single-GPU mode: copy/compute overlap vs serial and its bound; allocators (1 rank)",
    "pipeline": "full training iteration vs torch.distributed.pipelining + DDP",
    "gpt": "GPT LM on real text vs a plain torch GPT under torch.distributed.pipelining (fastest schedule, recipe, "
           "compile); recompute table",
    "eager": "--no-graph vs torch eager: 1F1B vs torch.distributed.pipelining (autocast, bf16), 1 GPU vs plain torch",
    "optimizer": "--shard-optimizer (ZeRO-1; with and without --overlap-param-gather) vs the all-reduce step and DDP + "
                 "ZeroRedundancyOptimizer (2+ ranks)",
    "checkpoint": "checkpoint save and load per GB (DCP format, verified) vs torch.save / torch.load (1 rank); "
                  "training time lost per save, --save-async vs a synchronous save, save / load GB/s per rank",
}

#: suites that measure between two GPUs: run under torchrun --nproc_per_node=2 (skipped with fewer ranks)
MIN_RANKS: dict[str, int] = {"p2p": 2, "allreduce": 2, "optimizer": 2}
#: suites of one process (its stages are streams of one device): skipped under a launcher of more ranks
MAX_RANKS: dict[str, int] = {"single": 1}


def describe(name: str) -> str:
    """One line on what suite `name` measures."""
    return DESCRIPTIONS.get(name, "")


def rank_reason(name: str, world: int) -> str | None:
    """Why suite `name` cannot run with `world` ranks, or None."""
    least, most = MIN_RANKS.get(name, 1), MAX_RANKS.get(name)
    if world < least:
        return f"needs {least} ranks (torchrun --nproc_per_node={least} launch/bench.py {name})"
    if most is not None and world > most:
        return f"runs on {most} rank{'s' if most > 1 else ''} (python launch/bench.py {name}), this run has {world}"
    return None


def skip_reason(module: ModuleType, args: argparse.Namespace, ctx: Any) -> str | None:
    """What this machine lacks for the suite (its own `skip_reason`), or None."""
    check = getattr(module, "skip_reason", None)
    return check(args, ctx) if callable(check) else None


def load_suite(name: str) -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why it is not available)."""
    if name not in SUITES:
        return None, f"unknown suite {name!r}"
    try:
        module = importlib.import_module(f"{__name__}.{SUITES[name]}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(f"suites.{SUITES[name]}"):
            return None, f"bench/suites/{SUITES[name]}.py is not written yet"
        return None, f"cannot import it: {exc}"
    except Exception as exc:  # noqa: BLE001 - one broken suite must not stop the others
        return None, f"cannot import it: {type(exc).__name__}: {exc}"
    if not callable(getattr(module, "run", None)):
        return None, f"bench/suites/{SUITES[name]}.py has no run(args, ctx)"
    return module, ""
