"""peerline-bench: run the named suites, each measuring peerline next to its anchor, and write the results.

    python launch/bench.py kernels graph single            (one GPU, or the CPU with --quick)
    torchrun --nproc_per_node=2 launch/bench.py all --quick

The flags are in bench/cli.py (`--help`), the suites in bench/suites/. A suite that cannot run here (too few or
too many ranks, no CUDA, an optional package missing) is skipped with a one-line reason; one that raises is
reported as failed and the others still run. A peerline variant that fails on one rank or hangs ends the whole job
within --deadline-s (noted in the results); with --isolate this process runs every measurement as a job of its own
instead (bench/isolation.py) and goes on after one fails; `--isolated-child DIR` makes it one of those jobs.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from peerline.bench import isolation, runtime_timing
from peerline.bench import suites as registry
from peerline.bench.benchkit import BenchContext
from peerline.bench.cli import PROG, build_parser, check_counts, resolve_suites, result_dir
from peerline.bench.display import Display
from peerline.bench.isolation_child import IsolatedChild
from peerline.distributed.env import detect_launch, init_distributed

log = logging.getLogger("peerline.bench")


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Device and process group (a one-rank group for a single process: the anchors need one)."""
    info = detect_launch()
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    device = torch.device("cuda", info.local_rank) if want_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if info.world_size == 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=args.timeout_s))
        else:
            init_distributed(info, device, args.timeout_s)
    return info.rank, info.world_size, device


def _why_not(name: str, args: argparse.Namespace, ctx: BenchContext, world: int) -> tuple[object, str]:
    """(suite module, "") when the suite can run here, else (None, "skipped: ..." / "not available: ...")."""
    why = registry.rank_reason(name, world)
    if why:
        return None, f"skipped: {why}"
    module, why = registry.load_suite(name)
    if module is None:
        return None, f"not available: {why}"
    why = registry.skip_reason(module, args, ctx)
    return (None, f"skipped: {why}") if why else (module, "")


def _run_one(name: str, module, args: argparse.Namespace, ctx: BenchContext) -> str:
    """Run one suite; its outcome ("ok: ..." or "failed: ...")."""
    before, t0 = len(ctx.records), time.perf_counter()
    try:
        module.run(args, ctx)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit from a suite included: report, go on
        if not isinstance(exc, SystemExit):
            log.exception("suite %s failed", name)
        return f"failed: {type(exc).__name__}: {exc}"
    return f"ok: {len(ctx.records) - before} records in {time.perf_counter() - t0:.1f} s"


def run_suites(names: list[str], args: argparse.Namespace, ctx: BenchContext, display: Display
               ) -> dict[str, str]:
    """Run each suite; returns name -> outcome ("ok", "skipped: ...", "not available: ...", "failed: ...")."""
    outcome: dict[str, str] = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name in names:
        module, why = _why_not(name, args, ctx, world)
        if module is None:
            outcome[name] = why
        else:
            display.step(f"{name}: running")
            ctx.on_step = _prefixed(display.step, name)
            outcome[name] = _run_one(name, module, args, ctx)
        display.advance()
    return outcome


def _prefixed(step: Callable[[str], None], name: str) -> Callable[[str], None]:
    return lambda what: step(f"{name}: {what}")


def _context(args: argparse.Namespace, argv: list[str] | None, rank: int, world: int, device: torch.device
             ) -> BenchContext:
    ctx = BenchContext(out_dir=result_dir(args), device=device, is_writer=rank == 0, quick=args.quick,
                       autosave_stem=None if args.isolated_child else args.stem)
    ctx.facts["world_size"] = world
    launcher = f"torchrun --nproc_per_node={world} " if world > 1 else "python "
    ctx.facts["command"] = launcher + "launch/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return ctx


def _finish(outcome: dict[str, str], ctx: BenchContext, stem: str, rank: int) -> None:
    """Notes for what did not run, the files, and one line per suite (rank 0)."""
    for name, what in outcome.items():
        if not what.startswith("ok"):
            ctx.note(f"suite {name}: {what}")
    paths = ctx.write(stem)
    if rank != 0:
        return
    for name, what in outcome.items():
        print(f"{PROG}: {name}: {what}", flush=True)
    if paths:
        print(f"{PROG}: wrote {paths[0]} and {paths[1]}", flush=True)


def _say(line: str) -> None:
    print(f"{PROG}: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """peerline-bench's entry: 0 when no suite failed, 1 when one did, 2 on a usage error."""
    args = build_parser().parse_args(argv)
    try:
        names = resolve_suites(args.suites)
        check_counts(args)
        if args.isolate and args.isolated_child is None:  # this process runs the jobs: no device, no group
            return isolation.run_isolated(names, args, sys.argv[1:] if argv is None else list(argv), _say)
        rank, world, device = setup(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {PROG}[{rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    ctx = _context(args, argv, rank, world, device)
    runtime_timing.DEADLINE_S = args.deadline_s
    runtime_timing.INJECTED = dict(args.inject_fault)
    child = None
    if args.isolated_child is not None:  # one job of an isolated run: its suite, its one measurement
        child = runtime_timing.ISOLATED = IsolatedChild.load(args.isolated_child, rank)
        names = [child.suite]
    display = Display(enabled=rank == 0, total=len(names))
    outcome: dict[str, str] = {}
    try:
        with display.running():
            outcome = run_suites(names, args, ctx, display)
        if child is not None:
            child.write_result(ctx, outcome[child.suite])
        else:
            _finish(outcome, ctx, args.stem, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 1 if any(v.startswith("failed") for v in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
