"""peerline.bench.suites: the benchmark suites of launch/bench.py, by name.

Each suite module exposes `run(args, ctx)` (see launch/benchkit.py) and may expose `add_arguments(parser)` for
its own flags. Suites that need two ranks are listed in MIN_RANKS. Modules are imported only when asked for, so a
suite whose module is missing, or cannot import on this machine, is reported as not available.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

#: suite name -> module under peerline.bench.suites, in the order `all` runs them
SUITES: dict[str, str] = {
    "kernels": "kernels",  # fused elementwise kernels vs torch eager
    "p2p": "p2p",  # copy-engine handoff vs NCCL send/recv
    "allreduce": "allreduce",  # bucketed all-reduce overlapped with backward vs DDP
    "batch_streams": "batch_streams",  # multi-stream batch driver: N streams vs one
    "graph": "graph",  # whole-iteration CUDA graph vs eager
    "single": "single",  # single-GPU mode: copy/compute overlap vs serial and its bound; allocators
    "pipeline": "pipeline",  # full training iteration vs torch.distributed.pipelining + DDP
}

#: suites that measure between two GPUs: run under torchrun --nproc_per_node=2 (skipped with fewer ranks)
MIN_RANKS: dict[str, int] = {"p2p": 2, "allreduce": 2}


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
