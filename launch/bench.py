"""peerline's benchmark suite: each suite measures peerline next to its anchor, in the same run, on the same GPUs.

    python launch/bench.py kernels graph single            (one GPU, or the CPU with --quick)
    torchrun --nproc_per_node=2 launch/bench.py p2p allreduce pipeline
    torchrun --nproc_per_node=2 launch/bench.py all --out runs/bench-h100

Suites: kernels, p2p, allreduce, batch_streams, graph, single, pipeline (bench/suites/). Results go to --out (default
runs/bench-<date>): results.jsonl (one JSON record per measurement, with card, driver and versions) and
results.md (a table with peerline, the anchor and their ratio). --quick runs tiny sizes (the CPU smoke test).
Exit status: 0 when no suite failed (a suite whose module is missing is reported as not available, one that needs
more ranks than this run has as skipped), 1 when one failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import torch
    import torch.distributed as dist

    from peerline.bench.benchkit import BenchContext
    from peerline.bench.suites import MIN_RANKS, SUITES, load_suite
except ImportError as exc:  # run from a checkout that was never installed
    print(f"peerline-bench: error: cannot import peerline ({exc}); install it first: pip install -e .",
          file=sys.stderr)
    sys.exit(2)

log = logging.getLogger("peerline.bench")
PROG = "peerline-bench"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="suites: " + ", ".join(SUITES) + ", or all")
    p.add_argument("suites", nargs="+", metavar="SUITE", help="suites to run, or all")
    p.add_argument("--out", type=Path, default=None, help="result folder (default runs/bench-<UTC date-time>)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test that runs on the CPU")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: each suite's own)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up repetitions (default: each suite's own)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=os.environ.get("PEERLINE_DEVICE", "auto"),
                   help="auto: the GPU of this rank when there is one (default $PEERLINE_DEVICE or auto)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="process-group timeout")
    p.add_argument("--stem", default="results", help="file name stem of the results")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    g = p.add_argument_group("kernels")
    g.add_argument("--kernel-sizes-mib", dest="kernel_sizes_mib", type=_floats, default=None,
                   help="tensor sizes, MiB, comma-separated")
    g = p.add_argument_group("p2p")
    g.add_argument("--p2p-sizes", dest="sizes", type=_ints, default=None, help="message sizes, bytes")
    g = p.add_argument_group("batch_streams")
    g.add_argument("--batches", type=int, default=None)
    g.add_argument("--batch-mib", dest="batch_mib", type=float, default=None)
    g.add_argument("--streams", dest="stream_counts", type=_ints, default=None)
    # Suites may add their own flags (add_arguments(parser)); the pipeline suite does.
    for name in SUITES:
        module, _ = load_suite(name)
        adder = getattr(module, "add_arguments", None)
        if adder is not None:
            try:
                adder(p.add_argument_group(name))
            except argparse.ArgumentError as exc:
                log.warning("suite %s: flag conflict, its flags are skipped: %s", name, exc)
    return p


def resolve_suites(names: list[str]) -> list[str]:
    """The suites to run, in the registry's order for `all`; ValueError names the first unknown one."""
    if "all" in names:
        return list(SUITES)
    for n in names:
        if n not in SUITES:
            raise ValueError(f"unknown suite {n!r}; choose from {', '.join(SUITES)} or all")
    return list(dict.fromkeys(names))


def _launch() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun / Slurm / MPI / single process."""
    try:
        from peerline.distributed.env import detect_launch

        info = detect_launch()
        return info.rank, info.world_size, info.local_rank
    except ImportError:
        env = os.environ
        return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Device and process group (a one-rank group for a single process: the anchors need one)."""
    rank, world, local = _launch()
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    device = torch.device("cuda", local) if want_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if not dist.is_initialized():
        if world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            try:
                from peerline.distributed.env import detect_launch, init_distributed

                init_distributed(detect_launch(), device, args.timeout_s)
            except ImportError:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return rank, world, device


class Display:
    """What runs now: a rich progress bar on a terminal, plain lines otherwise (rank 0 only)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self._progress = None
        self._task = None

    @contextmanager
    def running(self) -> Iterator[Display]:
        if self.enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), transient=False) as progress:
                self._progress = progress
                self._task = progress.add_task("starting", total=self.total)
                yield self
            self._progress = None
        else:
            yield self

    def step(self, what: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, description=what)
        else:
            print(f"{PROG}: {what}", flush=True)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)


def run_suites(names: list[str], args: argparse.Namespace, ctx: BenchContext, display: Display
               ) -> dict[str, str]:
    """Run each suite; returns name -> outcome ("ok", "not available: ...", "failed: ...")."""
    outcome: dict[str, str] = {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name in names:
        if world < MIN_RANKS.get(name, 1):
            outcome[name] = (f"skipped: needs {MIN_RANKS[name]} ranks "
                             f"(torchrun --nproc_per_node={MIN_RANKS[name]} launch/bench.py {name})")
            display.advance()
            continue
        module, why = load_suite(name)
        if module is None:
            outcome[name] = f"not available: {why}"
            display.advance()
            continue
        display.step(f"{name}: running")
        ctx.on_step = _prefixed(display.step, name)
        before, t0 = len(ctx.records), time.perf_counter()
        try:
            module.run(args, ctx)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a suite included: report, go on
            if not isinstance(exc, SystemExit):
                log.exception("suite %s failed", name)
            outcome[name] = f"failed: {type(exc).__name__}: {exc}"
        else:
            outcome[name] = f"ok: {len(ctx.records) - before} records in {time.perf_counter() - t0:.1f} s"
        display.advance()
    return outcome


def _prefixed(step: Callable[[str], None], name: str) -> Callable[[str], None]:
    return lambda what: step(f"{name}: {what}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = resolve_suites(args.suites)
        if args.reps is not None and args.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {args.reps}")
        if args.warmup is not None and args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        rank, world, device = setup(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {PROG}[{rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    out = args.out or Path("runs") / f"bench-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
    ctx = BenchContext(out_dir=out, device=device, is_writer=rank == 0, quick=args.quick, autosave_stem=args.stem)
    ctx.facts["world_size"] = world
    launcher = f"torchrun --nproc_per_node={world} " if world > 1 else "python "
    ctx.facts["command"] = launcher + "launch/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    display = Display(enabled=rank == 0, total=len(names))
    try:
        with display.running():
            outcome = run_suites(names, args, ctx, display)
        for name, what in outcome.items():
            if not what.startswith("ok"):
                ctx.note(f"suite {name}: {what}")
        paths = ctx.write(args.stem)
        if rank == 0:
            for name, what in outcome.items():
                print(f"{PROG}: {name}: {what}", flush=True)
            if paths:
                print(f"{PROG}: wrote {paths[0]} and {paths[1]}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 1 if any(v.startswith("failed") for v in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
