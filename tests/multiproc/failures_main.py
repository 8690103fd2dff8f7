"""Entry point of the failure tests: launch/pipeline.py's flow with the failure flags of distributed/failsafe.py.

Used by tests/multiproc/test_failures.py (and tests/gpu/run_failures.sh) while launch/pipeline.py does not carry
--save/--resume/--skip-nonfinite itself; it prints the same lines (`peerline: error: ...`, `peerline: final
loss=...`) and writes the same --json "losses".
"""

from __future__ import annotations

import json
import logging
import os
import sys

from peerline.distributed.config import ConfigError
from peerline.distributed.resilience import faults
from peerline.distributed.resilience.failsafe import Failsafe, add_failure_flags, failsafe_options
from peerline.distributed.runtime import Runtime
from peerline.launch.cli import build_parser, config_from_args


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    add_failure_flags(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    faults.active()  # a bad PEERLINE_FAULT fails here, before any process group exists
    rt = Runtime.create(cfg)
    try:
        fs = Failsafe.attach(rt, **failsafe_options(args))
        history = []
        losses = fs.train(on_iteration=history.append)
        if rt.info.rank == 0:
            if cfg.json:
                with open(cfg.json, "w") as f:
                    json.dump({"losses": [s.loss for s in history], "iterations": [s.iteration for s in history],
                               "start": fs.resumed_from}, f)
            final = losses[-1] if losses else float("nan")
            print(f"peerline: final loss={final:.9g} iterations={rt.iteration}", flush=True)
    finally:
        clean = rt.close()
    if clean is False:
        # As launch/pipeline.py: NCCL teardown of captured communicators is stuck; everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main() -> int:
    logging.basicConfig(level=os.environ.get("PEERLINE_LOG", "WARNING"),
                        format="%(asctime)s %(name)s [rank " + os.environ.get("RANK", "0") + "] %(message)s")
    try:
        return run()
    except ConfigError as exc:
        print(f"peerline: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
