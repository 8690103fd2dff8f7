"""What the run's hooks cost a host-bound eager iteration on one GPU: the eager suite's one-GPU cell (plain torch
eager against peerline --stages 1 --no-graph, same recipe) with a third side, peerline without the failsafe (no
watchdog or heartbeat thread, no per-iteration memory reads), all three resident and timed in alternating blocks.
`--gc-freeze` moves every object alive after set-up into Python's permanent generation first (gc.freeze), so that a
full collection during the timing walks only what the loops make.

    PYTHONPATH=$PWD:$PWD/tools/gpu_probes python3 tools/gpu_probes/eager_hooks_probe.py [--config launch] \
        [--recipe bf16] [--timed 10] [--reps 5]

INFO lines: each side's median ms per iteration and torch / side, and the garbage collections of each generation
during the timing (the process's, all sides together).
"""

from __future__ import annotations

import argparse
import gc

from eager_single_profile import one_gpu_cell

from peerline.bench.benchkit import time_blocks_interleaved
from peerline.bench.runtime_timing import open_runtime
from peerline.bench.suites.eager import SINGLE_RECIPES
from peerline.bench.suites.pipeline import CONFIGS
from peerline.distributed.runtime import Runtime


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="launch", choices=sorted(CONFIGS), help="the pipeline suite's shape")
    p.add_argument("--recipe", default="bf16", choices=sorted(SINGLE_RECIPES), help="precision recipe")
    p.add_argument("--timed", type=int, default=10, help="iterations per timed block (default 10)")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per side (default 5)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: the shape's)")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after set-up, before the timing")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device, shape, plain, cfg = one_gpu_cell(a)
    bare = Runtime.create(cfg)  # no hooks: no failsafe threads
    try:
        with open_runtime(cfg) as rt:  # as the eager suite runs it: the bench's failsafe attached
            sides = {"torch": lambda n: [plain.step() for _ in range(n)],
                     "peerline": lambda n: rt.train(rt.iteration + n),
                     "peerline, no failsafe": lambda n: bare.train(bare.iteration + n)}
            if a.gc_freeze:
                gc.freeze()
            before = [g["collections"] for g in gc.get_stats()]
            walls = time_blocks_interleaved(list(sides.values()), iters=a.timed, reps=a.reps, warmup=1,
                                            device=device)
            collections = [g["collections"] - b for g, b in zip(gc.get_stats(), before, strict=True)]
    finally:
        bare.close()
    base = walls[0].median_ms
    print(f"INFO {shape.name}, {a.recipe}, {device}: {shape.layers} blocks h={shape.hidden}, M={shape.microbatches}; "
          f"gc.freeze {'on' if a.gc_freeze else 'off'} ({gc.get_freeze_count()} objects frozen); collections by "
          f"generation while timed {collections}")
    for name, wall in zip(sides, walls):
        print(f"INFO {name:24s} {wall.median_ms:8.2f} ms/iter  torch / side {base / wall.median_ms:.3f}")


if __name__ == "__main__":
    main()
