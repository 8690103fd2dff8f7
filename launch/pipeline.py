"""peerline's main job: parse flags -> assemble the run -> train -> report.

    torchrun --nproc_per_node=2 launch/pipeline.py [flags]      (also srun, mpirun, or plain python)
"""

from __future__ import annotations

import logging
import os
import sys

if __package__ in (None, ""):
    # Run as a script from a checkout (torchrun launch/pipeline.py): make `import peerline` find the checkout
    # even when it was never installed (peerline/__init__.py maps the sibling folders).
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    # --allocator async must reach PyTorch before torch loads: read it from the command line first (no torch here).
    from peerline.distributed.memory.allocator import preconfigure_from_argv

    _ALLOCATOR_ERROR = preconfigure_from_argv(sys.argv[1:])
    import torch

    from peerline.distributed.config import ConfigError, RunConfig
    from peerline.distributed.env import detect_launch, launch_rank_world
    from peerline.distributed.hooks import IterationStats
    from peerline.distributed.observe.progress import ProgressReporter
    from peerline.distributed.observe.record import build_record, check_outputs, write_record
    from peerline.distributed.resilience import checkpoint_store, faults
    from peerline.distributed.resilience.failsafe import Failsafe
    from peerline.distributed.resilience.preemption import EXIT_PREEMPTED, Preemption, preempted_line
    from peerline.distributed.runtime import Runtime
    from peerline.launch.cli import build_parser, config_from_args
    from peerline.launch.messages import report_error, setup_logging, start_notices
except ImportError as exc:  # run from a checkout that was never installed
    print(f"peerline: error: cannot import peerline ({exc}); install it first: pip install -e .", file=sys.stderr)
    sys.exit(2)

log = logging.getLogger("peerline")


def run(argv: list[str] | None = None) -> int:
    """Parse -> assemble (with the failsafe hook) -> train -> report. Returns the exit code."""
    cfg = parse(argv)
    if cfg is None:
        return 0
    faults.active()  # a bad PEERLINE_FAULT is one clear line before anything starts
    check_outputs(cfg)  # an unwritable --json / --timeline / metrics output is one line now, not after training
    checkpoint_store.precheck(cfg.save, cfg.resume)  # a --save folder this run must not write: one line, now
    # The failsafe: watchdog, fault hooks, checkpoints at --save-every, --resume, the non-finite guard. Preemption
    # first: a signal stops every rank at one boundary, after the failsafe's final checkpoint.
    rt = Runtime.create(cfg, hooks=[Preemption.attach, Failsafe.attach])
    try:
        history = train(rt)
        if rt.stop_reason is None:
            report(rt, history)
        elif rt.info.rank == 0:
            print(preempted_line(rt.stop_reason, cfg.save, rt.iteration), flush=True)
    finally:
        clean = rt.close()
    code = 0 if rt.stop_reason is None else EXIT_PREEMPTED
    # Leave without the interpreter's teardown when it can only hurt: NCCL teardown stuck (captured communicators),
    # or any multi-rank run, whose exit-time destruction of c10d objects races with their own threads on a loaded
    # machine (gloo on 2 cores, torchrun and mpirun alike: "terminate called without an active exception" after the
    # final loss). Everything is written and the process group is destroyed by now. Under MPI every rank of a clean
    # run is here, so MPI is finalized first (mpirun counts a process that exits without MPI_Finalize as failed).
    if not clean or rt.info.world_size > 1:
        if clean and rt.info.launcher == "mpi":
            finalize_mpi()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def finalize_mpi() -> None:
    """MPI_Finalize through mpi4py where it initialized MPI (collective: every rank must call it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def parse(argv: list[str] | None) -> RunConfig | None:
    """The run's configuration from the command line; None when there is nothing to train (--print-schedule)."""
    args = build_parser().parse_args(argv)
    if _ALLOCATOR_ERROR:
        raise ConfigError(_ALLOCATOR_ERROR)
    cfg = config_from_args(args)
    if args.print_schedule:
        print_schedule(cfg)
        return None
    rank, _ = launch_rank_world()
    if cfg.device == "auto" and not torch.cuda.is_available() and rank == 0:
        print("peerline: no GPU found; running the same pipeline on the CPU with gloo", flush=True)
    return cfg


def print_schedule(cfg: RunConfig) -> None:
    """The schedule of the grid this launch would train (pp from the world and --dp), printed by rank 0. A single
    process given --pp previews that grid's schedule without launching it."""
    from peerline.distributed.assemble import whole_w_first_stage
    from peerline.distributed.pipeline import schedule
    from peerline.distributed.pipeline.placed import placed_schedule

    info = detect_launch()
    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    pp = cfg.pp if info.world_size == 1 and cfg.pp is not None else cfg.resolved_pp(info.world_size)
    n_stages = pp * cfg.stages
    placed = placed_schedule(cfg.schedule, pp, cfg.stages, cfg.microbatches, cfg.zb_memory,  # several per rank
                             cfg.zb_order)
    programs = None if placed else schedule.build(cfg.schedule, n_stages, cfg.microbatches, memory=cfg.zb_memory)
    table = placed.render() if placed else schedule.render(programs)
    ring = None
    if programs is not None and pp > 1:
        ring_programs = schedule.build(cfg.schedule, n_stages, cfg.microbatches, memory=cfg.zb_memory,
                                       rendezvous=not whole_w_first_stage(cfg, torch.device("cuda" if gpu else "cpu")))
        if ring_programs != programs:
            ring = schedule.render(ring_programs)
    if info.rank == 0:
        print(f"schedule {cfg.schedule}: {n_stages} stage(s) (pp={pp} x stages/rank={cfg.stages}), dp={cfg.dp}, "
              f"M={cfg.microbatches}\n{table}", flush=True)
        if ring is not None:
            print(f"where every edge runs on the copy engine (GPUs of one host), this order instead:\n{ring}",
                  flush=True)


def train(rt: Runtime) -> list[IterationStats]:
    """The start lines (rank 0), then training with a progress line per logged iteration; returns their stats."""
    cfg = rt.cfg
    is_writer = rt.info.rank == 0
    if is_writer:
        print(f"peerline: {rt.info.world_size} rank(s) via {rt.info.launcher}, pp={rt.mesh.pp} dp={rt.mesh.dp} "
              f"stages/rank={cfg.stages}, schedule {cfg.schedule}, M={cfg.microbatches}, device "
              f"{rt.device.type}, p2p {rt.transport_name}", flush=True)
        print(f"peerline: {rt.workload}; {rt.split}", flush=True)
        for notice in [*start_notices(cfg, rt.device), *rt.notices]:
            print(f"peerline: {notice}", flush=True)
    history: list[IterationStats] = []
    with ProgressReporter(cfg.iters, enabled=is_writer, start=rt.iteration, launcher=rt.info.launcher) as progress:
        def on_iteration(stats: IterationStats) -> None:
            history.append(stats)
            progress.update(stats)

        rt.train(on_iteration=on_iteration)
    return history


def report(rt: Runtime, history: list[IterationStats]) -> None:
    """The --json record (observe/record.py) and the final line (rank 0; the record's checksums are gathered from
    every rank). A run that had nothing left to train (resumed at --iters) has no final loss to print."""
    cfg = rt.cfg
    checksums = rt.layer_checksums() if cfg.json else {}
    optimizer_bytes = rt.optimizer_state_bytes_per_rank() if cfg.json else None
    held = rt.state_bytes_per_rank() if cfg.json else None
    if rt.info.rank != 0:
        return
    if cfg.json:
        write_record(cfg.json, {**build_record(rt, history, checksums), "optimizer_state_bytes": optimizer_bytes,
                                "state_bytes": held})
    if history:
        print(f"peerline: final loss={history[-1].loss:.9g} iterations={rt.iteration}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The console script: run, with a bad input as one error line per job (launch/messages.py), exit 2."""
    setup_logging()
    try:
        return run(argv)
    except ConfigError as exc:
        report_error(str(exc), exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
