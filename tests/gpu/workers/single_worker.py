"""Child process of tests/gpu/test_single_gpu.py: one allocator backend, chosen before torch is imported.

    python tests/gpu/workers/single_worker.py KIND THRESHOLD OUT.json      (THRESHOLD: bytes, or 'none')

Runs, with the staging feed and variable-size scratch (ScratchJitter) on 2 stages of one GPU, fp32:
  1. eager, 4 iterations issued back to back (host runs ahead), per-iteration losses from the d2h results;
  2. a second Runtime of the same seed with graphs on (graph.py: 1 eager warm-up iteration, then the iteration is
     captured and replayed for iterations 1..3; the feed's load() stays outside the graph).
Writes JSON: the backend torch runs, the pool's release threshold read back, losses and checksums of both runs,
the allocation count, and graph_error (the reason) when capture or replay failed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from peerline.distributed.memory.allocator import configure_allocator  # noqa: E402  (no torch import yet)

KIND, THRESHOLD, OUT = sys.argv[1], None if sys.argv[2] == "none" else int(sys.argv[2]), sys.argv[3]
configure_allocator(KIND, THRESHOLD)

import torch  # noqa: E402

from peerline.bench.load import ScratchJitter  # noqa: E402
from peerline.distributed.config import RunConfig  # noqa: E402
from peerline.distributed.memory.allocator import (  # noqa: E402
    active_allocator,
    allocation_count,
    allocator_stats,
    apply_release_threshold,
)
from peerline.distributed.memory.staging import attach  # noqa: E402
from peerline.distributed.runtime import Runtime  # noqa: E402

ITERS = 4
DEVICE = os.environ.get("SINGLE_WORKER_DEVICE", "cuda")  # cpu: a smoke test of the eager part only


def build(graph: bool):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = RunConfig(hidden=128, layers=4, seq=64, micro_batch_size=2, microbatches=4, stages=2, schedule="1f1b",
                    dtype="fp32", kernels="torch", device=DEVICE, iters=1000, seed=11, graph=graph, warmup_iters=1,
                    allocator=KIND, pool_release_threshold=THRESHOLD)  # the backend chosen above, said explicitly
    rt = Runtime.create(cfg)
    feed = attach(rt, results="losses")
    ScratchJitter(0.5, cfg.microbatches).install([s.module for s in rt.engine.stages.values()])
    return rt, feed


def losses_of(results) -> list[float]:
    return [float(r.losses.double().mean()) for r in results]


def main() -> None:
    device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out: dict = {"kind": KIND, "active": active_allocator(), "threshold": THRESHOLD}
    out["threshold_read"] = apply_release_threshold(device, THRESHOLD)
    rt, feed = build(graph=False)
    for _ in range(ITERS):
        rt.run_iteration()
    out["eager_losses"] = losses_of(feed.drain())
    out["eager_checksums"] = rt.layer_checksums()
    out["allocs"] = allocation_count(device)
    rt.engine.transport.close()
    del rt, feed
    try:
        if device.type != "cuda":
            raise RuntimeError("no CUDA graphs on the CPU")
        rt, feed = build(graph=True)
        for _ in range(ITERS):  # iteration 0 eager, then captured (cudagraph/policy.py) and replayed
            rt.run_iteration()
        if rt.graph is None:
            raise RuntimeError(f"graph.py fell back to eager: {rt.graph_failed}")
        out["graph_losses"] = losses_of(feed.drain())
        out["graph_checksums"] = rt.layer_checksums()
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
        out["graph_traceback"] = traceback.format_exc()[-3000:]
    out["stats"] = allocator_stats(device)
    Path(OUT).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
