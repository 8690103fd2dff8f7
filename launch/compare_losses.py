"""Compare training runs' loss curves against a reference run (did a faster recipe train the same?).

  python -m peerline.launch.compare_losses master=a.jsonl[,a2.jsonl...] bf16=b.jsonl compact=c.jsonl [--plot p.png]

Each argument is NAME=FILE, a --metrics-jsonl file of launch/pipeline.py (log every iteration: --log-every 1);
the first is the reference. Each other run gets one line: whether its smoothed curve stays within the
reference's own noise (distributed/observe/loss_compare.py says how that is measured). The reference may name
several runs of its recipe (NAME=FILE,FILE,...; different seeds, say): then a run also passes while its gaps stay
within `--bound` x how far those runs drift apart, and the line says which yardstick set each allowed gap. Another
name with several files is compared run by run (NAME#1, NAME#2, ...). --plot draws every run's raw and smoothed
losses in one PNG (needs matplotlib). Exit status: 0 when every run matches, 1 when one does not, 2 on bad input
(one `peerline: error:` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peerline.distributed.observe import loss_compare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m peerline.launch.compare_losses",
                                description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="NAME=FILE[,FILE...]",
                   help="--metrics-jsonl files; the first is the reference. Several runs of the reference recipe "
                        "(NAME=a.jsonl,b.jsonl) let the gap allowed grow to --bound x how far they drift apart; "
                        "another name's files are compared one by one")
    p.add_argument("--window", type=int, default=loss_compare.DEFAULT_WINDOW,
                   help="iterations of the moving average (default %(default)s)")
    p.add_argument("--skip", type=int, default=loss_compare.DEFAULT_SKIP,
                   help="first iterations left out of the gap (default %(default)s)")
    p.add_argument("--bound", type=float, default=loss_compare.DEFAULT_BOUND,
                   help="allowed gap in units of the reference's noise, or of its runs' spread when that is larger "
                        "(default %(default)s)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of every curve here")
    p.add_argument("--title", default="loss", help="the plot's title")
    return p.parse_args(argv)


def fail(message: str) -> int:
    print(f"peerline: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    curves: dict[str, list[dict[int, float]]] = {}
    for item in args.runs:
        name, sep, files = item.partition("=")
        if not sep or not name or not files or not all(files.split(",")):
            return fail(f"{item!r} is not NAME=FILE or NAME=FILE,FILE,...")
        curves[name] = []
        for file in files.split(","):
            try:
                losses = loss_compare.read_losses(Path(file))
            except (OSError, ValueError, KeyError, TypeError) as e:
                return fail(f"cannot read losses from {file}: {e}")
            if not losses:
                return fail(f"{file} holds no finite losses")
            curves[name].append(losses)
    if len(curves) < 2:
        return fail("give a reference and at least one run to compare with it")
    (ref_name, refs), *others = curves.items()
    try:
        loss_compare.check_references(refs)
    except ValueError as e:
        return fail(f"{ref_name}: {e}")
    reference = refs[0] if len(refs) == 1 else refs
    status = 0
    for name, runs in others:
        for k, losses in enumerate(runs, start=1):
            label = name if len(runs) == 1 else f"{name}#{k}"
            try:
                result = loss_compare.compare(reference, losses, args.window, args.skip, args.bound)
            except ValueError as e:
                return fail(f"{label} against {ref_name}: {e}")
            print(result.describe(label, ref_name))
            status = status or (0 if result.matches else 1)
    if args.plot is not None:
        if loss_compare.plot(curves, args.window, args.plot, args.title) is None:
            print("peerline: no plot: matplotlib is not installed", file=sys.stderr)
        else:
            print(f"peerline: plot written to {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
