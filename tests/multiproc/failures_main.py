"""A second entry point for the failure tests: launch/pipeline.py's flow (its parser and config, the runtime with the
failsafe hook) reduced to what the tests read: the same lines (`peerline: error: ...`, `peerline: final loss=...`)
and a --json record of the losses, their iterations and the iteration training (re)started from.

tests/multiproc/failures_util.py uses launch/pipeline.py itself while its parser carries --save.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from peerline.distributed.config import ConfigError
from peerline.distributed.resilience import faults
from peerline.distributed.resilience.failsafe import Failsafe
from peerline.distributed.runtime import Runtime
from peerline.launch.cli import build_parser, config_from_args


def run(argv: list[str] | None = None) -> int:
    cfg = config_from_args(build_parser().parse_args(argv))
    faults.active()  # a bad PEERLINE_FAULT fails here, before any process group exists
    rt = Runtime.create(cfg, hooks=[Failsafe.attach])  # --save/--resume/--skip-nonfinite come from cfg
    try:
        start = rt.iteration  # after a resume: the iteration of the checkpoint
        history = []
        losses = rt.train(on_iteration=history.append)
        if rt.info.rank == 0:
            if cfg.json:
                with open(cfg.json, "w") as f:
                    json.dump({"losses": [s.loss for s in history], "iterations": [s.iteration for s in history],
                               "start": start}, f)
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
