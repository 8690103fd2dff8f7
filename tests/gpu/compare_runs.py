"""Compare two --json results of launch/pipeline.py: per-iteration losses and per-layer parameter checksums.

    python tests/gpu/compare_runs.py RESULT.json REFERENCE.json --rtol 1e-5 --label "pp=2 vs 1 GPU"

Prints one PASS/FAIL line; exit code 1 on FAIL.
"""

import argparse
import json
import sys
from pathlib import Path

# Run as a script from anywhere: the checkout root holds the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import comparison_line, worst_difference  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("reference")
    p.add_argument("--rtol", type=float, required=True)
    p.add_argument("--label", required=True)
    a = p.parse_args()
    try:
        got, ref = (json.load(open(x)) for x in (a.result, a.reference))
    except (OSError, ValueError) as exc:
        print(f"FAIL {a.label}: cannot read results ({exc})")
        return 1
    worst, where = worst_difference(got, ref)
    same_len = len(got["losses"]) == len(ref["losses"]) > 0
    ok = same_len and worst <= a.rtol
    print(f"{'PASS' if ok else 'FAIL'} {a.label}: {comparison_line(got, ref, worst, where, a.rtol)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
