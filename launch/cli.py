"""The command line of launch/pipeline.py: flags map one-to-one onto RunConfig fields."""

from __future__ import annotations

import argparse
import dataclasses
import os

from peerline.distributed.config import (
    ALLOCATORS,
    ALLREDUCE_PRIORITIES,
    DATA_SOURCES,
    DEVICES,
    DTYPES,
    GRAD_SYNCS,
    KERNELS,
    P2P,
    SCHEDULES,
    STAGINGS,
    ConfigError,
    RunConfig,
)
from peerline.distributed.resilience.failsafe import add_failure_flags

_DEFAULTS = RunConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/pipeline.py",
        description="Train a pipelined model across GPUs (pp stages x dp replicas) and report loss and speed. "
                    "Start with torchrun (--nproc_per_node=N), srun, mpirun, or plainly for one GPU / the CPU.",
        epilog="examples:\n"
               "  torchrun --nproc_per_node=2 launch/pipeline.py                 two stages, one per GPU\n"
               "  torchrun --nproc_per_node=4 launch/pipeline.py --pp 2 --dp 2   2 stages x 2 replicas\n"
               "  python launch/pipeline.py --stages 4                           4 stages on one GPU\n"
               "  PEERLINE_DEVICE=cpu torchrun --nproc_per_node=2 launch/pipeline.py   the CPU, gloo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("grid")
    g.add_argument("--pp", type=int, help="pipeline stages across ranks (default: world size / dp)")
    g.add_argument("--dp", type=int, default=_DEFAULTS.dp, help="data-parallel replicas (default: %(default)s)")
    g.add_argument("--stages", type=int, default=_DEFAULTS.stages,
                   help="stages on this one device, as separate streams (single-GPU mode; default: %(default)s)")
    g = p.add_argument_group("schedule and batch")
    g.add_argument("--schedule", choices=SCHEDULES, default=_DEFAULTS.schedule, help="(default: %(default)s)")
    g.add_argument("--microbatches", "-m", type=int, default=_DEFAULTS.microbatches,
                   help="microbatches per iteration and replica (default: %(default)s)")
    g.add_argument("--micro-batch-size", type=int, default=_DEFAULTS.micro_batch_size,
                   help="sequences per microbatch (default: %(default)s)")
    g.add_argument("--global-batch", type=int, help="sequences per iteration over all replicas "
                   "(sets --micro-batch-size; must divide by dp x microbatches)")
    g.add_argument("--seq", type=int, default=_DEFAULTS.seq, help="tokens per sequence (default: %(default)s)")
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=_DEFAULTS.hidden, help="hidden size (default: %(default)s)")
    g.add_argument("--layers", type=int, default=_DEFAULTS.layers,
                   help="residual MLP blocks (default: %(default)s)")
    g.add_argument("--model", help="a user model 'pkg.module:factory' returning an nn.Sequential")
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="(default: %(default)s)")
    g.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="AdamW learning rate (default: %(default)s)")
    g = p.add_argument_group("execution")
    g.add_argument("--iters", type=int, default=_DEFAULTS.iters,
                   help="iterations from the start of training (default: %(default)s)")
    g.add_argument("--device", choices=DEVICES, default=os.environ.get("PEERLINE_DEVICE", _DEFAULTS.device),
                   help="default: $PEERLINE_DEVICE, else auto (CUDA when available)")
    g.add_argument("--dtype", choices=DTYPES, help="bf16 autocast (default on GPU) or fp32 (default on CPU)")
    g.add_argument("--kernels", choices=KERNELS, default=_DEFAULTS.kernels,
                   help="elementwise kernels (default: %(default)s = peerline on GPU, torch on CPU)")
    g.add_argument("--p2p", choices=P2P, default=_DEFAULTS.p2p,
                   help="stage-to-stage transport (default: %(default)s = copy engine between GPUs of a host)")
    g.add_argument("--p2p-lanes", type=int, default=_DEFAULTS.p2p_lanes,
                   help="copy-engine send streams (default: %(default)s, messages round robin)")
    g.add_argument("--p2p-split", action=argparse.BooleanOptionalAction, default=_DEFAULTS.p2p_split,
                   help="copy-engine: copy each message's halves on two lanes at once (default: off)")
    g.add_argument("--p2p-decoupled", action=argparse.BooleanOptionalAction, default=_DEFAULTS.p2p_decoupled,
                   help="copy-engine: flags on the last two lanes, copies alone on the others (default: off)")
    g.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture each iteration into a CUDA graph (default: on for GPUs)")
    g.add_argument("--warmup-iters", type=int, default=_DEFAULTS.warmup_iters,
                   help="eager iterations before graph capture (default: %(default)s)")
    g.add_argument("--graph-loop", type=int, default=_DEFAULTS.graph_loop, metavar="K",
                   help="iterations per host launch of the graph: K > 1 loops the captured iteration on the device, "
                        "the host launching once per K iterations (default: %(default)s; --log-every then "
                        "defaults to K)")
    g.add_argument("--grad-sync", choices=GRAD_SYNCS, default=_DEFAULTS.grad_sync,
                   help="data-parallel gradient average (default: %(default)s)")
    g.add_argument("--bucket-mb", type=float, default=_DEFAULTS.bucket_mb, help="(default: %(default)s)")
    g.add_argument("--first-bucket-mb", type=float, default=_DEFAULTS.first_bucket_mb,
                   help="(default: %(default)s)")
    g.add_argument("--nccl-max-ctas", type=int, default=_DEFAULTS.nccl_max_ctas,
                   help="cap on the CTAs (SMs) of the dp group's NCCL all-reduce kernels, 0 = NCCL's default "
                        "(default: %(default)s, measured on H200; see docs/benchmarks)")
    g.add_argument("--allreduce-priority", choices=ALLREDUCE_PRIORITIES, default=_DEFAULTS.allreduce_priority,
                   help="all-reduce stream priority: highest (a ready bucket is not queued behind backward) or "
                        "normal (as DDP's), for comparison; graphs ignore stream priorities (default: %(default)s)")
    g.add_argument("--timeout-s", type=float, default=_DEFAULTS.timeout_s,
                   help="deadline for any wait, seconds (default: %(default)s)")
    g.add_argument("--data", choices=DATA_SOURCES, default=_DEFAULTS.data,
                   help="synthetic data: seeded (torch's generator, reseeded on the host per iteration) or counter "
                        "(a counter-based hash made on the device inside the graph: no host work per iteration; "
                        "default: %(default)s)")
    g.add_argument("--staging", choices=STAGINGS, default=_DEFAULTS.staging,
                   help="inputs/results: direct, or pinned (host ring + h2d/d2h streams; default: %(default)s)")
    g.add_argument("--allocator", choices=ALLOCATORS, default=os.environ.get("PEERLINE_ALLOCATOR") or None,
                   help="device allocator: caching or async (cudaMallocAsync; default: $PEERLINE_ALLOCATOR, else "
                        "the backend PYTORCH_CUDA_ALLOC_CONF selects)")
    g.add_argument("--pool-release-threshold", type=int,
                   help="bytes the async pool keeps across synchronizations (default: all)")
    g.add_argument("--seq-jitter", type=float, default=_DEFAULTS.seq_jitter,
                   help="variable-size scratch per microbatch: sequence varies by up to this fraction (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=int, default=None,
                   help=f"read the loss back every N iterations (default: {_DEFAULTS.log_every}, or K with "
                        "--graph-loop K)")
    g.add_argument("--json", help="write config, losses, timings and versions to this file (rank 0)")
    g.add_argument("--timeline", help="write a timeline of the last iteration: PATH.png and PATH.json")
    g.add_argument("--print-schedule", action="store_true", help="print the schedule as a table and exit")
    add_failure_flags(p)  # --save --save-every --resume --skip-nonfinite
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Map parsed flags onto RunConfig (its __post_init__ raises ConfigError on bad values)."""
    names = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("log_every", 0) is None:  # not given: read the loss once per looped launch
        values["log_every"] = max(values.get("graph_loop") or 1, 1)
    return RunConfig(**values)


__all__ = ["build_parser", "config_from_args", "ConfigError"]
