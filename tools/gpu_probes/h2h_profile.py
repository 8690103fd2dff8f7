"""Diagnostic (GPU machine, torchrun --nproc_per_node=2): where does peerline's eager step spend host time that
DDP's does not? The allreduce suite's launch-heavy head-to-head shape (16 blocks h=512, 4 microbatches of 4x256,
bf16) is host-bound in eager mode, so its step time is the host's. Rank 0 prints, for each variant, the host time
per step and the operators with the most self CPU time (torch.profiler, CPU activity only), so the two tables can
be read side by side. Not a test: it asserts nothing and prints INFO lines.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from peerline.bench.suites.allreduce_workload import (
    Shape,
    Workload,
    build_model,
    make_optimizer,
    step_ddp,
    step_peerline,
)
from peerline.distributed.grad_sync.buckets import GradBuckets
from peerline.distributed.streams import use


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    shape = Shape(hidden=512, blocks=16, micro_batch=4, seq=256, microbatches=4)
    w = Workload(shape, dev)
    with use(w.streams.compute):
        model, ddp_model = build_model(shape, torch.bfloat16, dev), build_model(shape, torch.bfloat16, dev)
        ddp = DistributedDataParallel(ddp_model, device_ids=[local], bucket_cap_mb=25, gradient_as_bucket_view=True)
    gb = GradBuckets([list(b.parameters()) for b in model], dist.group.WORLD, dev, w.streams.allreduce, 25, 1)
    steps = {"DDP": partial(step_ddp, w, ddp, make_optimizer(ddp, dev)),
             "peerline eager": partial(step_peerline, w, model, gb, make_optimizer(model, dev)),
             "local (no sync)": partial(step_peerline, w, model, gb, make_optimizer(model, dev), sync=False)}
    with use(w.streams.compute):
        for fn in steps.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        for name, fn in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            host_ms = (time.perf_counter() - t0) / 5 * 1e3
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            if dist.get_rank() == 0:
                print(f"INFO {name}: host {host_ms:.2f} ms per step (issue time, no sync)", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    gb.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
