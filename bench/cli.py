"""The command line of peerline-bench: the common flags, each suite's own flags, and the suite names.

Flags a suite adds with its `add_arguments(group)` sit in that suite's group of `--help`; the shared size flags of
kernels, p2p and batch_streams are declared here, in the same groups.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

from peerline import overrides
from peerline.bench import suites as registry
from peerline.choices import DEVICES

log = logging.getLogger("peerline.bench")
PROG = "peerline-bench"

DESCRIPTION = """\
peerline's benchmark suites: each one measures peerline next to its anchor (torch eager, NCCL, DDP,
torch.distributed.pipelining), in the same run, on the same GPUs.

examples:
  python launch/bench.py kernels graph single            (one GPU, or the CPU with --quick)
  torchrun --nproc_per_node=2 launch/bench.py p2p allreduce pipeline
  torchrun --nproc_per_node=2 launch/bench.py all --out runs/bench-h100
  torchrun --nproc_per_node=2 launch/bench.py all --quick  (the CPU smoke test)

Results go to --out (default runs/bench-<UTC date-time>): results.jsonl (one JSON record per measurement, with
card, driver and versions) and results.md (a table of peerline, the anchor and their ratio, then the notes).
A suite that cannot run on this machine or with this many ranks is skipped with a one-line reason.
A variant that fails on one rank or hangs ends the job within --deadline-s; with --isolate each measurement of the
pipeline and gpt suites (and each other suite) is a job of its own, so the bench notes the failure and goes on:
  torchrun --nproc_per_node=2 launch/bench.py pipeline gpt --isolate
  python launch/bench.py pipeline --quick --isolate --ranks 2
Exit status: 0 when no suite failed, 1 when one failed, 2 on a usage error."""


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _epilog() -> str:
    width = max(map(len, registry.SUITES))
    lines = [f"  {name:<{width}}  {registry.describe(name)}" for name in registry.SUITES]
    return "suites (in the order `all` runs them):\n" + "\n".join(lines)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="+", metavar="SUITE", help="suites to run, or all")
    p.add_argument("--out", type=Path, default=None, help="result folder (default runs/bench-<UTC date-time>)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test that runs on the CPU")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: each suite's own)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up repetitions (default: each suite's own)")
    p.add_argument("--device", choices=DEVICES, default=overrides.get_str("PEERLINE_DEVICE", "auto"),
                   help="auto: the GPU of this rank when there is one (default $PEERLINE_DEVICE or auto)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="process-group timeout")
    p.add_argument("--deadline-s", type=float, default=120.0,
                   help="deadline on a peerline measurement's progress: a variant that fails on one rank or waits "
                        "this long ends the job with one line naming the rank, noted in the results (default "
                        "%(default)s); with --isolate that job is the measurement's own and the bench goes on")
    p.add_argument("--stem", default="results", help="file name stem of the results")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _add_isolation(p)


def _fault(text: str) -> tuple[str, str]:
    """--inject-fault ID=SPEC -> (ID, SPEC), SPEC checked with PEERLINE_FAULT's grammar."""
    from peerline.distributed.resilience.faults import FaultSpecError, parse_faults

    mid, eq, spec = text.partition("=")
    if not eq or not mid.strip() or not spec.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not MEASUREMENT=SPEC")
    try:
        parse_faults(spec)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return mid.strip(), spec.strip()


def _add_isolation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("isolation (bench/isolation.py)")
    g.add_argument("--isolate", action="store_true",
                   help="run every measurement of the pipeline and gpt suites (every other suite whole) as a job of "
                        "its own: one that fails or hangs is ended with its whole process tree, noted with its "
                        "rank's error line, and the bench goes on; the results merge into one results.jsonl / .md. "
                        "Launch it as usual (torchrun --nproc_per_node=N launch/bench.py ... --isolate: rank 0 runs "
                        "the jobs, each on N ranks of this host) or as one process with --ranks N")
    g.add_argument("--ranks", type=int, default=None,
                   help="with --isolate from one process: ranks of each job (default: torchrun's, else 1)")
    g.add_argument("--isolate-timeout-s", type=float, default=1800.0,
                   help="with --isolate: a job still running after this many seconds is ended and noted as not "
                        "finished (default %(default)s; --deadline-s ends a stuck peerline variant sooner)")
    g.add_argument("--inject-fault", type=_fault, action="append", default=[], metavar="MEASUREMENT=SPEC",
                   help="for tests: PEERLINE_FAULT's SPEC in the runtimes of one measurement only, e.g. "
                        "'pipeline quick 1f1b eager=raise:rank=1:iter=3' (repeatable)")
    g.add_argument("--isolated-child", type=Path, default=None, help=argparse.SUPPRESS)


def _group(p: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup], name: str
           ) -> argparse._ArgumentGroup:
    """The `--help` group of suite `name`, made on first use."""
    if name not in groups:
        groups[name] = p.add_argument_group(f"{name} suite")
    return groups[name]


def _add_shared_sizes(p: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup]) -> None:
    _group(p, groups, "kernels").add_argument("--kernel-sizes-mib", dest="kernel_sizes_mib", type=_floats,
                                              default=None, help="tensor sizes, MiB, comma-separated")
    _group(p, groups, "p2p").add_argument("--p2p-sizes", dest="sizes", type=_ints, default=None,
                                          help="message sizes, bytes, comma-separated")
    g = _group(p, groups, "batch_streams")
    g.add_argument("--batches", type=int, default=None, help="batches per measurement")
    g.add_argument("--batch-mib", dest="batch_mib", type=float, default=None, help="MiB per batch")
    g.add_argument("--streams", dest="stream_counts", type=_ints, default=None,
                   help="stream counts to compare, comma-separated")


def usage_name(argv0: str | None = None) -> str:
    """The name `usage:` shows: the console script's (peerline-bench), or the script's path as typed
    (launch/bench.py); an absolute path (python -m) shows as the module."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if not argv0.endswith(".py"):
        return os.path.basename(argv0) or PROG
    return "python -m peerline.launch.bench" if os.path.isabs(argv0) else argv0


def build_parser() -> argparse.ArgumentParser:
    """The full parser: common flags, then one group per suite with its own flags."""
    p = argparse.ArgumentParser(prog=usage_name(),
                                usage="%(prog)s SUITE [SUITE ...] [options]   (SUITE: a name below, or all)",
                                description=DESCRIPTION, epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(p)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in registry.SUITES:
        _group(p, groups, name)
    _add_shared_sizes(p, groups)
    for name in registry.SUITES:
        module, _ = registry.load_suite(name)
        adder = getattr(module, "add_arguments", None)
        if adder is None:
            continue
        try:
            adder(groups[name])
        except argparse.ArgumentError as exc:
            log.warning("suite %s: flag conflict, its flags are skipped: %s", name, exc)
    return p


def result_dir(args: argparse.Namespace) -> Path:
    """--out, or runs/bench-<UTC date-time>."""
    return args.out or Path("runs") / f"bench-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"


def resolve_suites(names: list[str]) -> list[str]:
    """The suites to run, in the registry's order for `all`; ValueError names the first unknown one."""
    if "all" in names:
        return list(registry.SUITES)
    for n in names:
        if n not in registry.SUITES:
            raise ValueError(f"unknown suite {n!r}; choose from {', '.join(registry.SUITES)} or all")
    return list(dict.fromkeys(names))


def check_counts(args: argparse.Namespace) -> None:
    """ValueError for a repetition count no suite could use."""
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
