"""A benchmark's one-GPU measurement in a fresh process: rank 0 starts it on its own GPU while the other ranks wait,
so nothing of the suite's process group, runtimes or allocator state is in it. The eager suite's one-GPU part, the
gpt suite's --gpt-single and the pipeline suite's bubble-free time run their children through here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext
from peerline.bench.runtime_timing import BlockTimer

#: a launcher's variables, left out of a one-GPU child's environment (a process of its own, not a rank)
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
CHILD_TIMEOUT_S = 900
T = TypeVar("T")


def child_spec(args: argparse.Namespace, quick: bool, iters: int | None) -> dict[str, Any]:
    """What a one-GPU child needs of the bench's arguments: --quick, iterations per block, --reps, --warmup."""
    return {"quick": bool(quick), "iters": iters, "reps": getattr(args, "reps", None),
            "warmup": getattr(args, "warmup", None)}


def child_device() -> torch.device:
    """The child's device: its only visible GPU (made current), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def child_timer(spec: dict[str, Any], device: torch.device) -> BlockTimer:
    """The child's BlockTimer: the bench's --reps / --warmup and the suite's iterations per block (child_spec)."""
    counts = argparse.Namespace(reps=spec.get("reps"), warmup=spec.get("warmup"))
    return BlockTimer.from_args(counts, spec["quick"], device, spec.get("iters"))


def on_rank0(fn: Callable[[], T]) -> T | None:
    """`fn` on rank 0 while the other ranks wait at a barrier (reached even when `fn` raises); None on the others."""
    try:
        return fn() if dist.get_rank() == 0 else None
    finally:
        dist.barrier()


def run_fresh_child(ctx: BenchContext, entry: str, spec: dict[str, Any], path: Path) -> dict[str, Any] | str:
    """Runs `entry` ("module:function", called as function(spec, out_path)) in a fresh process of one rank on this
    rank's GPU and returns the JSON it wrote at `path`; why not (its error's tail) when it failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    module, function = entry.split(":")
    code = f"import json, sys\nfrom {module} import {function}\n{function}(json.loads(sys.argv[1]), sys.argv[2])\n"
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec), str(path)], capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S, env=_child_env(ctx.device))
    except subprocess.TimeoutExpired:
        return f"the child process ran past {CHILD_TIMEOUT_S} s and was ended"
    if proc.returncode != 0 or not path.exists():
        return f"the child process failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(path.read_text())


def _child_env(device: torch.device) -> dict[str, str]:
    """This process's environment less the launcher's variables, with this rank's GPU as the only visible one and
    the folder this process imports peerline from first on PYTHONPATH (a checkout run as launch/bench.py)."""
    import peerline

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    root = str(Path(peerline.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if device.type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = _visible_device(device)
    return env


def _visible_device(device: torch.device) -> str:
    """This rank's GPU as the child's only visible device (a CUDA_VISIBLE_DEVICES list is respected)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = device.index or 0
    return visible[index] if index < len(visible) else str(index)
