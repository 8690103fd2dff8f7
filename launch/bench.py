"""peerline's benchmark entry: run suites that measure peerline next to its anchors (bench/, peerline.bench).

    python launch/bench.py kernels graph single            (one GPU, or the CPU with --quick)
    torchrun --nproc_per_node=2 launch/bench.py all --quick
    torchrun --nproc_per_node=2 launch/bench.py pipeline gpt --isolate   (each measurement a job of its own)
    python launch/bench.py --help                          (suites and their flags)

The benchmarks are not part of the main job (launch/pipeline.py imports none of them); their extra packages come
with `pip install 'peerline[bench]'`.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script from a checkout (torchrun launch/bench.py): make `import peerline` find the checkout
    # even when it was never installed (peerline/__init__.py maps the sibling folders).
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    from peerline.bench.main import main
except ImportError as exc:  # run from a checkout that was never installed
    print(f"peerline-bench: error: cannot import peerline ({exc}); install it first: pip install -e .",
          file=sys.stderr)
    sys.exit(2)

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
