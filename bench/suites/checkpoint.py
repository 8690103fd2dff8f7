"""Benchmark suite `checkpoint`: save and load of a peerline checkpoint (DCP format) per GB, against torch.save and
torch.load of the same state (one rank); and what a save costs a run in progress, synchronous against
--save-async, with save / load GB/s per rank (any number of ranks: checkpoint_async.py).

    python launch/bench.py checkpoint [--checkpoint-gb 1.0] [--checkpoint-dir DIR] [--checkpoint-every N]
    torchrun --nproc_per_node=4 launch/bench.py checkpoint [--checkpoint-dir DIR]        (the training part only)
    python launch/bench.py checkpoint --quick                (16 MB; the training part on the tiny CPU GPT)

The state is a model's worth of fp32 tensors (weights plus AdamW's two moments, so a third of it is weights) on
the CPU or the device. peerline's save is the whole atomic save: DCP's writer (fsync per file), the SHA-256 of
every file, the manifest, the rename and the folder fsyncs; its load verifies every file's SHA-256 and reads the
tensors back by name into existing tensors. The anchor is torch.save into one file plus an fsync, and torch.load
(weights_only, into new tensors). Both run in one process on the same folder and file system, median of a few
repetitions; the page cache serves both loads alike (the files were just written), so the load figures compare
the formats' costs, not the disk's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.suites import checkpoint_async
from peerline.distributed.resilience import checkpoint as ckpt

SUITE = "checkpoint"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--checkpoint-gb", type=float, default=1.0, help="checkpoint suite: size of the saved "
                       "state in GB (default: %(default)s; --quick: 0.016)")
    group.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="checkpoint suite: folder to write "
                       "into (default: a temporary folder; name one on the file system your checkpoints go to, "
                       "shared by every node)")
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="checkpoint suite, training "
                       "part: iterations between saves (default: enough to cover 1.5 synchronous saves; 0: no "
                       "training part)")


def make_state(n_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Layers of [1024, 1024] fp32 weights with their exp_avg and exp_avg_sq, about `n_bytes` in all."""
    per = 1024 * 1024 * 4
    layers = max(1, n_bytes // (3 * per))
    state = {}
    for i in range(layers):
        state[f"model.layers.{i}.weight"] = torch.randn(1024, 1024, device=device)
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"optim.layers.{i}.weight.{key}"] = torch.randn(1024, 1024, device=device)
    return state


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """The file comparison (one rank), then the training part (unless --checkpoint-every 0)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        run_files(args, ctx)
    else:
        ctx.note("checkpoint: the file comparison against torch.save runs on one rank (python launch/bench.py "
                 "checkpoint); this run measures the training part only")
    if getattr(args, "checkpoint_every", None) != 0:
        checkpoint_async.run_training(args, ctx)


def run_files(args: argparse.Namespace, ctx: BenchContext) -> None:
    """peerline's save and load of a state of --checkpoint-gb against torch.save and torch.load (module docstring)."""
    gb = 0.016 if ctx.quick else args.checkpoint_gb
    reps = 1 if ctx.quick else 3
    state = make_state(int(gb * 1e9), ctx.device)
    size = sum(t.numel() * t.element_size() for t in state.values())
    parent = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="peerline-ckpt-bench-", dir=parent))
    try:
        counter = iter(range(1, 1 << 30))
        save_s = _median_s(lambda: ckpt.save_checkpoint(root / "dcp", 0, next(counter), state, {"model": {}}),
                           reps)
        anchor_save_s = _median_s(lambda: _torch_save(state, root / "state.pt"), reps)
        last = max(int(p.name[5:]) for p in (root / "dcp").glob("iter_*"))
        targets = {k: torch.empty_like(v) for k, v in state.items()}
        load_s = _median_s(lambda: ckpt.load_checkpoint(root / "dcp", {"model": {}}, lambda shapes: targets, last),
                           reps)
        anchor_load_s = _median_s(lambda: torch.load(root / "state.pt", map_location=ctx.device, weights_only=True),
                                  reps)
        if not all(torch.equal(targets[k], state[k]) for k in state):
            raise AssertionError("the loaded checkpoint differs from the saved state")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sizes = {"GB": round(size / 1e9, 3), "tensors": len(state), "device": str(ctx.device)}
    for case, ours, theirs, anchor in (("save", save_s, anchor_save_s, "torch.save + fsync"),
                                       ("load", load_s, anchor_load_s, "torch.load weights_only")):
        ctx.record(Record(SUITE, case, "GB/s", size / 1e9 / ours, size / 1e9 / theirs, anchor, sizes=sizes,
                          extra={"seconds": ours, "anchor_seconds": theirs}))
    ctx.note(f"checkpoint: {size / 1e9:.3f} GB; save {save_s:.3f} s (torch.save {anchor_save_s:.3f} s), load "
             f"{load_s:.3f} s (torch.load {anchor_load_s:.3f} s); peerline's figures include SHA-256 of every file")
