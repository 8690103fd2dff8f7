"""peerline's main job: parse flags -> assemble the run -> train -> report.

    torchrun --nproc_per_node=2 launch/pipeline.py [flags]      (also srun, mpirun, or plain python)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

if __package__ in (None, ""):
    # Run as a script from a checkout (torchrun launch/pipeline.py): make `import peerline` find the checkout
    # even when it was never installed (peerline/__init__.py maps the sibling folders).
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    # --allocator async must reach PyTorch before torch loads: read it from the command line first (no torch here).
    from peerline.distributed.memory.allocator import preconfigure_from_argv

    _ALLOCATOR_ERROR = preconfigure_from_argv(sys.argv[1:])
    import torch

    from peerline import overrides
    from peerline.distributed.config import ConfigError, RunConfig
    from peerline.distributed.hooks import IterationStats
    from peerline.distributed.observe.progress import ProgressReporter
    from peerline.distributed.observe.versions import versions
    from peerline.distributed.resilience import faults
    from peerline.distributed.resilience.failsafe import Failsafe
    from peerline.distributed.runtime import Runtime
    from peerline.launch.cli import build_parser, config_from_args
except ImportError as exc:  # run from a checkout that was never installed
    print(f"peerline: error: cannot import peerline ({exc}); install it first: pip install -e .", file=sys.stderr)
    sys.exit(2)

log = logging.getLogger("peerline")
ERROR_GRACE_S = 2.0


def run(argv: list[str] | None = None) -> int:
    """Parse -> assemble (with the failsafe hook) -> train -> report. Returns the exit code."""
    cfg = parse(argv)
    if cfg is None:
        return 0
    faults.active()  # a bad PEERLINE_FAULT is one clear line before anything starts
    # The failsafe: watchdog, fault hooks, checkpoints at --save-every, --resume, the non-finite guard.
    rt = Runtime.create(cfg, hooks=[Failsafe.attach])
    try:
        history = train(rt)
        report(rt, history)
    finally:
        clean = rt.close()
    # Leave without the interpreter's teardown when it can only hurt: NCCL teardown stuck (captured communicators),
    # or any multi-rank run not under MPI, whose exit-time destruction of c10d objects raced with their own threads
    # once in CI (gloo, 4 ranks on 2 cores: "terminate called without an active exception" after the final loss).
    # Everything is written and the process group is destroyed by now. Under MPI, mpi4py must still finalize.
    if not clean or (rt.info.world_size > 1 and rt.info.launcher != "mpi"):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def parse(argv: list[str] | None) -> RunConfig | None:
    """The run's configuration from the command line; None when there is nothing to train (--print-schedule)."""
    args = build_parser().parse_args(argv)
    if _ALLOCATOR_ERROR:
        raise ConfigError(_ALLOCATOR_ERROR)
    cfg = config_from_args(args)
    if args.print_schedule:
        from peerline.distributed.pipeline import schedule
        print(schedule.render(schedule.build(cfg.schedule, (cfg.pp or 1) * cfg.stages, cfg.microbatches)))
        return None
    rank = overrides.get_int("RANK", overrides.get_int("SLURM_PROCID", 0))
    if cfg.device == "auto" and not torch.cuda.is_available() and rank == 0:
        print("peerline: no GPU found; running the same pipeline on the CPU with gloo", flush=True)
    return cfg


def train(rt: Runtime) -> list[IterationStats]:
    """The start lines (rank 0), then training with a progress line per logged iteration; returns their stats."""
    cfg = rt.cfg
    is_writer = rt.info.rank == 0
    if is_writer:
        print(f"peerline: {rt.info.world_size} rank(s) via {rt.info.launcher}, pp={rt.mesh.pp} dp={rt.mesh.dp} "
              f"stages/rank={cfg.stages}, schedule {cfg.schedule}, M={cfg.microbatches}, device "
              f"{rt.device.type}, p2p {rt.transport_name}; {rt.split}", flush=True)
        for notice in rt.notices:
            print(f"peerline: {notice}", flush=True)
    history: list[IterationStats] = []
    with ProgressReporter(cfg.iters, enabled=is_writer, start=rt.iteration) as progress:
        def on_iteration(stats: IterationStats) -> None:
            history.append(stats)
            progress.update(stats)

        rt.train(on_iteration=on_iteration)
    return history


def report(rt: Runtime, history: list[IterationStats]) -> None:
    """The --json record and the final line (rank 0; the checksums for the record are gathered from every rank)."""
    cfg = rt.cfg
    checksums = rt.layer_checksums() if cfg.json else {}
    if rt.info.rank != 0:
        return
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"config": cfg.to_dict(), "world_size": rt.info.world_size, "launcher": rt.info.launcher,
                       "transport": rt.transport_name, "graph": rt.graph is not None,
                       "graph_loop": rt.graph_loop, "graph_loop_failed": rt.graph_loop_failed,
                       "losses": [s.loss for s in history], "iterations": [s.iteration for s in history],
                       "ms_per_iter": [s.ms for s in history],
                       "tokens_per_s": [s.tokens_per_s for s in history],
                       "peak_mem_gb": max((s.peak_mem_gb for s in history), default=0.0),
                       "peak_mem_gb_per_rank": history[-1].peak_mem_gb_per_rank if history else None,
                       "tflops": [s.tflops for s in history], "mfu": [s.mfu for s in history],
                       "ppl": [s.ppl for s in history],
                       "layer_checksums": checksums,
                       "versions": versions()}, f, indent=1)
    final = history[-1].loss if history else float("nan")
    print(f"peerline: final loss={final:.9g} iterations={rt.iteration}", flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=overrides.get_str("PEERLINE_LOG", "WARNING"),
                        format="%(asctime)s %(name)s [rank " + overrides.get_str("RANK", "0") + "] %(message)s")
    try:
        return run(argv)
    except ConfigError as exc:
        print(f"peerline: error: {exc}", file=sys.stderr, flush=True)
        if overrides.get_int("WORLD_SIZE", 1) > 1:
            # torchrun stops the other ranks as soon as one exits: a short grace lets every rank, which checks
            # the same input at the same point, print its own line first.
            time.sleep(ERROR_GRACE_S)
        return 2


if __name__ == "__main__":
    sys.exit(main())
