"""The checkpoint suite's training part: what a checkpoint costs a run in progress, a synchronous save against
`--save-async`, and save / load GB/s per rank, on peerline's GPT (the gpt suite's compute configuration, 24 blocks,
hidden 2048, about 1.3 B parameters, resized by the --gpt-* size flags; --quick: its tiny CPU one), pp = the world
size, with the main job's failsafe doing the saves.

After a warm-up (graph capture) the suite times a few iterations and one synchronous save, and picks N, the
iterations between saves (--checkpoint-every, default: enough to cover 1.5 synchronous saves, as a run that saves
less often than it can write). Then, after one async block of warm-up (the first background save pins its host
buffers), --reps rounds of three blocks of N iterations, in rotation:

  none    N iterations
  sync    a synchronous save at the block's start, then N iterations
  async   a background save at the block's start (the copy to host memory), N iterations while it is written, then
          the wait for it (nothing when it finished in time)

Every block starts all ranks together and counts the slowest rank's time. Training time lost per save = the median
block with a save minus the median block without (issue 32's goal: async <= 10 % of sync). Per rank: the checkpoint
bytes over the synchronous save's time (device sync, write, hashes, manifest) and over the background write's time
(its thread, start to end); the load is the resume's (every file's SHA-256 verified, tensors read by name into the
model); torch.save + fsync and torch.load (weights_only) of the same host tensors per rank are the anchors. The
slowest rank's figure is recorded, every rank's in `extra`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.runtime_timing import measure_or_note, open_runtime
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as ckpt_store
from peerline.distributed.streams import use

log = logging.getLogger(__name__)

SUITE = "checkpoint"
KINDS = ("none", "sync", "async")
#: --checkpoint-every's default: iterations that cover this many synchronous saves
COVER = 1.5
PROBE_ITERS = 3


def _shape(args: argparse.Namespace, quick: bool) -> Any:
    from peerline.bench.suites.gpt import shape_named

    return shape_named(args, "quick" if quick else "compute")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared_folder(parent: str | None) -> Path:
    """A new folder every rank writes into (rank 0 makes it; on several nodes, --checkpoint-dir must be shared)."""
    rank, world = _world()
    if rank == 0 and parent:
        Path(parent).mkdir(parents=True, exist_ok=True)  # --checkpoint-dir names a folder to write into, as --save
    name = [tempfile.mkdtemp(prefix="peerline-ckpt-train-", dir=parent) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _slowest(value: float) -> float:
    return max(_everyone(value))


def _everyone(value: Any) -> list[Any]:
    _, world = _world()
    if world == 1:
        return [value]
    got: list[Any] = [None] * world
    dist.all_gather_object(got, value)
    return got


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    """This rank's seconds of `fn`, every rank starting together (nothing in flight), the device synchronized."""
    if _world()[1] > 1:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _block(rt: Any, fs: Any, kind: str, every: int, mine: dict[str, list[float]]) -> None:
    """One block (module docstring); this rank's save and wait times go into `mine`."""
    n, t0 = rt.iteration, time.perf_counter()
    if kind != "none":
        fs.save(n, background=kind == "async")
    mine[f"{kind}_save_s"].append(time.perf_counter() - t0)
    rt.train(n + every)
    t1 = time.perf_counter()
    fs.wait_for_save()
    mine[f"{kind}_wait_s"].append(time.perf_counter() - t1)


def _rounds(rt: Any, fs: Any, every: int, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(the blocks' slowest-rank seconds by kind, this rank's save and wait seconds by name), after a warm-up round."""
    blocks: dict[str, list[float]] = {k: [] for k in KINDS}
    mine: dict[str, list[float]] = {f"{k}_{w}_s": [] for k in KINDS for w in ("save", "wait")}
    # The warm-up is one async block: the first background save pins its host buffers. The synchronous path was
    # warmed by _pick_every's save, and the iterations by the run's own warm-up.
    _slowest(_timed(lambda: _block(rt, fs, "async", every, {k: [] for k in mine}), rt.device))
    for _ in range(reps):
        for kind in KINDS:
            blocks[kind].append(_slowest(_timed(lambda kind=kind: _block(rt, fs, kind, every, mine), rt.device)))
    return blocks, mine


def _pick_every(rt: Any, fs: Any, args: argparse.Namespace) -> tuple[int, float, float]:
    """(N, seconds per iteration, seconds of a synchronous save), all the slowest rank's."""
    per_iter = _slowest(_timed(lambda: rt.train(rt.iteration + PROBE_ITERS), rt.device)) / PROBE_ITERS
    sync_s = _slowest(_timed(lambda: fs.save(rt.iteration, background=False), rt.device))
    every = getattr(args, "checkpoint_every", None) or max(PROBE_ITERS, math.ceil(COVER * sync_s / per_iter))
    return every, per_iter, sync_s


def _load_and_anchors(rt: Any, fs: Any, root: Path) -> dict[str, float]:
    """This rank's seconds: the resume's load of the checkpoint (--keep 1: the only one, so one to verify),
    torch.save + fsync and torch.load of the same host tensors (the staging buffers)."""
    rank, world = _world()
    expected = ckpt.expected_of(fs.manifest)

    def load() -> None:
        with use(rt.engine.main_stream):
            ckpt_store.resume(str(root), None, rank, world, expected, lambda line: None, fs.state.template)

    load_s = _timed(load, rt.device)
    path = root / f"anchor-rank{rank}.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(fs.saver.staging.buffers, f)
            f.flush()
            os.fsync(f.fileno())

    save_s = _timed(save, rt.device)
    torch_load_s = _timed(lambda: torch.load(path, weights_only=True), rt.device)
    path.unlink()
    return {"load_s": load_s, "torch_save_s": save_s, "torch_load_s": torch_load_s}


def _measure(args: argparse.Namespace, ctx: BenchContext, shape: Any, root: Path) -> dict[str, Any]:
    """Everything the records need, on every rank (collective)."""
    # --keep 1: at most two checkpoints on disk at once (the compute shape's is about 21 GB on one rank)
    cfg = shape.run_config(None, device=ctx.device.type, iters=10**9, save=str(root), save_async=True, keep=1)
    with open_runtime(cfg) as rt:
        fs = rt.hooks[-1]
        rt.train(rt.iteration + rt.cfg.warmup_iters + 2)  # warm-up and, on a GPU, the graph's capture
        rt.cfg = replace(rt.cfg, log_every=10**9)  # the loss is read once per block, at its end
        every, per_iter, first_sync_s = _pick_every(rt, fs, args)
        reps = getattr(args, "reps", None) or (1 if ctx.quick else 2)
        if _world()[0] == 0:  # a long run at GB scale: say how long before it starts
            minutes = (every * per_iter + reps * (len(KINDS) * every * per_iter + 2 * first_sync_s)) / 60
            log.info("checkpoint: %d iterations between saves (an iteration %.3f s, a synchronous save %.1f s); "
                     "a warm-up block and %d rounds of %d blocks: about %.1f min (--reps sets the rounds)", every,
                     per_iter, first_sync_s, reps, len(KINDS), minutes)
        blocks, mine = _rounds(rt, fs, every, reps)
        writes = fs.saver.done[-reps:]
        bytes_mine = fs.saver.staging.nbytes()
        mine.update(write_s=[w.write_s for w in writes], stage_s=[w.stage_s for w in writes])
        mine.update(_load_and_anchors(rt, fs, root))
        mine["bytes"] = bytes_mine
        mine["pinned_bytes"] = bytes_mine - fs.saver.staging.unpinned_bytes if ctx.device.type == "cuda" else 0
        per_rank = _everyone(mine)
    return {"every": every, "per_iter_s": per_iter, "first_sync_s": first_sync_s, "reps": reps,
            "blocks": blocks, "per_rank": per_rank, "world": _world()[1], "shape": shape}


def _gbps(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    """Every rank's GB/s: its bytes over the median of its `key` seconds."""
    out = []
    for r in per_rank:
        value = r[key]
        seconds = statistics.median(value) if isinstance(value, list) else value
        out.append(r["bytes"] / 1e9 / max(seconds, 1e-9))
    return out


def _report(ctx: BenchContext, m: dict[str, Any]) -> None:
    """The three records (lost time per save; save and load GB/s per rank) and a note."""
    med = {k: statistics.median(v) for k, v in m["blocks"].items()}
    lost = {k: med[k] - med["none"] for k in ("sync", "async")}
    floor = 1e-3  # a ratio needs positive times: a loss below 1 ms is within the blocks' noise
    per_rank, shape = m["per_rank"], m["shape"]
    sizes = {**shape.sizes(), "pp": m["world"], "GB_per_rank": [round(r["bytes"] / 1e9, 3) for r in per_rank],
             "iterations_between_saves": m["every"]}
    extra = {"blocks_s": m["blocks"], "block_medians_s": med, "lost_s": lost, "ms_per_iteration": 1e3 * m["per_iter_s"],
             "async_over_sync": lost["async"] / lost["sync"] if lost["sync"] > 0 else None, "goal": "<= 0.10",
             "per_rank": per_rank, "first_sync_save_s": m["first_sync_s"], "reps": m["reps"]}
    ctx.record(Record(SUITE, "training time lost per save, async vs sync", "s", max(lost["async"], floor),
                      max(lost["sync"], floor), "synchronous save", higher_is_better=False, sizes=sizes, extra=extra))
    write, sync = _gbps(per_rank, "write_s"), _gbps(per_rank, "sync_save_s")
    torch_save = _gbps(per_rank, "torch_save_s")
    ctx.record(Record(SUITE, "save GB/s per rank, background write vs synchronous save", "GB/s", min(write),
                      min(sync), "synchronous save (device sync, write, hashes)", sizes=sizes,
                      extra={"write_GBps": write, "sync_save_GBps": sync, "torch_save_fsync_GBps": torch_save,
                             "stage_GBps": _gbps(per_rank, "stage_s")}))
    load, torch_load = _gbps(per_rank, "load_s"), _gbps(per_rank, "torch_load_s")
    ctx.record(Record(SUITE, "load GB/s per rank (resume: verify and read)", "GB/s", min(load), min(torch_load),
                      "torch.load weights_only of the same tensors", sizes=sizes,
                      extra={"load_GBps": load, "torch_load_GBps": torch_load}))
    share = extra["async_over_sync"]
    ctx.note(f"checkpoint training ({shape.name}, pp={m['world']}, {m['every']} iterations between saves, "
             f"{1e3 * m['per_iter_s']:.1f} ms/iteration): lost per save {lost['async']:.3f} s async vs "
             f"{lost['sync']:.3f} s sync (" + (f"{100 * share:.1f} %" if share is not None else "no ratio") +
             "; goal <= 10 %)")


def run_training(args: argparse.Namespace, ctx: BenchContext) -> None:
    """The training part of the checkpoint suite (module docstring)."""
    shape = _shape(args, ctx.quick)
    root = _shared_folder(getattr(args, "checkpoint_dir", None))
    failures: list[str] = []
    try:
        got = measure_or_note(ctx, SUITE, f"training {shape.name}", lambda: _measure(args, ctx, shape, root),
                              failures)
    finally:
        if _world()[0] == 0:
            shutil.rmtree(root, ignore_errors=True)
    if got is not None:
        _report(ctx, got)
    if failures:
        raise RuntimeError("the checkpoint suite's training part failed: " + " | ".join(failures))
