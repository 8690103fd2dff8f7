"""Compare two --json results of launch/pipeline.py: per-iteration losses and per-layer parameter checksums.

    python tests/gpu/compare_runs.py RESULT.json REFERENCE.json --rtol 1e-5 --label "pp=2 vs 1 GPU"

Prints one PASS/FAIL line; exit code 1 on FAIL.
"""

import argparse
import json
import sys


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
    worst = 0.0
    for x, y in zip(got["losses"], ref["losses"]):
        worst = max(worst, abs(x - y) / abs(y))
    ref_sums = {k.split("/")[1]: v for k, v in ref["layer_checksums"].items()}
    for key, (s, sq) in got["layer_checksums"].items():
        rs, rsq = ref_sums[key.split("/")[1]]
        worst = max(worst, abs(s - rs) / max(1.0, abs(rs)), abs(sq - rsq) / abs(rsq))
    same_len = len(got["losses"]) == len(ref["losses"]) > 0
    ok = same_len and worst <= a.rtol
    print(f"{'PASS' if ok else 'FAIL'} {a.label}: worst relative difference {worst:.3g} (bound {a.rtol:g}); "
          f"losses {[f'{v:.6f}' for v in got['losses']]} vs {[f'{v:.6f}' for v in ref['losses']]}; "
          f"graph={got.get('graph')} transport={got.get('transport')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
