"""The run's configuration: one dataclass, documented fields, cross-field checks.

The command line (launch/cli.py) maps onto `RunConfig`. Checks that need no process group run here, so every rank
rejects a bad configuration with the same one-line `ConfigError` before anything can hang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")
DTYPES = ("bf16", "fp32")
DEVICES = ("auto", "cuda", "cpu")
KERNELS = ("auto", "peerline", "torch")
P2P = ("auto", "copy-engine", "nccl")
GRAD_SYNCS = ("buckets", "per-param")
ALLREDUCE_PRIORITIES = ("highest", "normal")
ALLOCATORS = ("caching", "async")
STAGINGS = ("direct", "pinned")
DATA_SOURCES = ("seeded", "counter")


class ConfigError(ValueError):
    """A user error: printed as one line `peerline: error: <message>`, exit code 2, on every rank."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    pp: int | None = None
    """Pipeline stages across ranks (default: the world size divided by dp)."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline."""
    stages: int = 1
    """Stages per rank, run as separate streams of one device (single-GPU mode: --stages N)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe or 1f1b."""
    microbatches: int = 4
    """Microbatches per iteration and replica (M)."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    global_batch: int | None = None
    """Sequences per iteration over all replicas; when given, micro_batch_size = global_batch / (dp * M)."""
    seq: int = 64
    """Tokens per sequence."""
    hidden: int = 128
    """Hidden size of the default model."""
    layers: int = 8
    """Residual MLP blocks of the default model."""
    model: str | None = None
    """A user model: 'pkg.module:factory' returning an nn.Sequential (replaces the default model)."""
    seed: int = 0
    """Seed of the weights and of the synthetic data."""
    iters: int = 5
    """Iterations counted from the start of training (a resumed run continues up to this number)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    device: str = "auto"
    """auto (CUDA when available), cuda, or cpu."""
    dtype: str | None = None
    """bf16 (autocast; default on GPU) or fp32 (default on CPU)."""
    kernels: str = "auto"
    """Elementwise kernels: peerline (warp-specialized CUDA), torch, or auto (peerline on GPU)."""
    p2p: str = "auto"
    """Stage-to-stage transport: copy-engine, nccl (gloo on CPU), or auto."""
    p2p_lanes: int = 2
    """Send streams of the copy-engine transport (2: messages round robin over two lanes)."""
    p2p_split: bool = False
    """Copy-engine transport: each message's halves copied at once by two lanes (needs an even --p2p-lanes)."""
    p2p_decoupled: bool = False
    """Copy-engine transport: the last two lanes carry the FREE / FULL flags, the others only copies (--p2p-lanes
    >= 3, not with --p2p-split)."""
    graph: bool | None = None
    """Capture each iteration into a CUDA graph (default on GPU; ignored on the CPU)."""
    warmup_iters: int = 3
    """Eager iterations before a CUDA graph is captured."""
    graph_loop: int = 1
    """Iterations per host launch of the graph: K > 1 replays the captured iteration K times from one launch (a
    WHILE node on the device, the K iterations' data staged on the device first: graph_loop.py), so the host's
    launch cost is paid once per K iterations. Needs --log-every a multiple of K (launches also end at --save-every
    checkpoints); a graph that cannot be looped (copy-engine flags between GPUs) replays one iteration per
    launch, with a notice."""
    grad_sync: str = "buckets"
    """Data-parallel gradient average: buckets (bucketed all-reduce overlapped with backward) or per-param."""
    bucket_mb: float = 25.0
    """Gradient bucket size for the data-parallel all-reduce, MiB."""
    first_bucket_mb: float = 1.0
    """Size of the first (last-layer) bucket, MiB, so the all-reduce starts early."""
    nccl_max_ctas: int | None = 16
    """Cap on the CTAs (SMs) of the dp group's NCCL kernels (bucket all-reduces overlapped with backward); 0 or
    None: NCCL's default. The buckets of the stage's first layer, which nothing is left to overlap, run on an
    uncapped twin group (Mesh.dp_tail_group). Measured on 2 x H200 (dp=2, docs/benchmarks, 2026-11-26 calls 4-5):
    against NCCL's default CTAs, 16 left less all-reduce exposed after backward (0.175 vs 0.334 ms) and was ahead
    on the launch-heavy model (1.016x vs 0.991x DDP in shuffled interleaved rounds), level on the GPU-bound one
    (1.016x vs 1.027x, within the round-to-round spread)."""
    allreduce_priority: str = "highest"
    """Priority of the all-reduce stream: highest (the device's highest, so a ready bucket's all-reduce is not
    queued behind backward kernels) or normal (as DDP's NCCL stream), for comparison. Eager iterations only: a
    CUDA graph launched as torch instantiates it ignores the priorities of the streams it was captured from."""
    timeout_s: float = 300.0
    """Deadline for any wait: process-group timeout and the per-iteration watchdog."""
    log_every: int = 1
    """Read the loss back (one host sync) every N iterations."""
    json: str | None = None
    """Write config, losses, timings and versions to this JSON file (rank 0)."""
    timeline: str | None = None
    """Write a timeline (PNG + Chrome trace) of the last iteration with this path stem."""
    data: str = "seeded"
    """Synthetic data: seeded (torch's generator reseeded per iteration and microbatch on the host) or counter (a
    hash of (seed, iteration, microbatch, element) made on the device from an iteration counter, inside the CUDA
    graph: no host work per iteration; counter_data.py)."""
    staging: str = "direct"
    """Inputs and results: direct (generated on the device into the static buffers) or pinned (generated on the
    host, equal to the CPU's data, staged through a ring of pinned slots on the h2d stream; per-microbatch losses
    back on the d2h stream: distributed/staging.py)."""
    allocator: str | None = None
    """Device allocator: caching (PyTorch's) or async (cudaMallocAsync pool); chosen before torch loads. None: the
    one the environment chose (PYTORCH_CUDA_ALLOC_CONF; caching unless it names cudaMallocAsync)."""
    pool_release_threshold: int | None = None
    """Bytes the async allocator's pool keeps across synchronizations (default: all of it)."""
    seq_jitter: float = 0.0
    """Variable-size per-microbatch scratch (sequence length varies by up to this fraction; 0: off)."""

    def __post_init__(self) -> None:
        def choose(name: str, value: object, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")

        choose("schedule", self.schedule, SCHEDULES)
        choose("device", self.device, DEVICES)
        choose("kernels", self.kernels, KERNELS)
        choose("p2p", self.p2p, P2P)
        choose("grad sync", self.grad_sync, GRAD_SYNCS)
        choose("staging", self.staging, STAGINGS)
        choose("data", self.data, DATA_SOURCES)
        if self.data == "counter" and self.staging != "direct":
            raise ConfigError("--data counter makes the data on the device: it needs --staging direct")
        if self.allocator is not None:
            choose("allocator", self.allocator, ALLOCATORS)
        if not 0.0 <= self.seq_jitter < 1.0:
            raise ConfigError(f"--seq-jitter must be in [0, 1), got {self.seq_jitter}")
        if self.pool_release_threshold is not None:
            if self.allocator == "caching":
                raise ConfigError("--pool-release-threshold applies to --allocator async only")
            if self.pool_release_threshold < 0:
                raise ConfigError(f"--pool-release-threshold must be >= 0 bytes, got {self.pool_release_threshold}")
        if self.dtype is not None:
            choose("dtype", self.dtype, DTYPES)
        for name in ("dp", "stages", "microbatches", "micro_batch_size", "seq", "hidden", "layers", "iters",
                     "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.p2p_lanes < 1 or (self.p2p_split and self.p2p_lanes % 2):
            raise ConfigError(f"--p2p-lanes must be >= 1 (and even with --p2p-split), got {self.p2p_lanes}")
        if self.p2p_decoupled and (self.p2p_split or self.p2p_lanes < 3):
            raise ConfigError(f"--p2p-decoupled needs --p2p-lanes >= 3 and no --p2p-split, got {self.p2p_lanes}")
        if self.pp is not None and self.pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {self.pp}")
        if self.graph_loop < 1:
            raise ConfigError(f"--graph-loop must be >= 1, got {self.graph_loop}")
        if self.graph_loop > 1 and self.log_every % self.graph_loop:
            raise ConfigError(f"--graph-loop {self.graph_loop} runs {self.graph_loop} iterations per launch: "
                              f"--log-every must be a multiple of it, got {self.log_every}")
        if self.graph_loop > 1 and self.staging != "direct":
            raise ConfigError("--graph-loop needs --staging direct (the looped iterations read data staged on the "
                              "device)")
        if self.warmup_iters < 1:
            raise ConfigError(f"--warmup-iters must be >= 1, got {self.warmup_iters}")
        if self.nccl_max_ctas is not None and not 0 <= self.nccl_max_ctas <= 64:
            raise ConfigError(f"--nccl-max-ctas must be in 0..64 (0: NCCL's default), got {self.nccl_max_ctas}")
        if self.allreduce_priority not in ALLREDUCE_PRIORITIES:
            raise ConfigError(f"--allreduce-priority must be one of {', '.join(ALLREDUCE_PRIORITIES)}, got "
                              f"{self.allreduce_priority!r}")
        if self.bucket_mb <= 0 or self.first_bucket_mb <= 0:
            raise ConfigError("--bucket-mb and --first-bucket-mb must be positive")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be positive, got {self.timeout_s}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.global_batch is not None:
            per = self.dp * self.microbatches
            if self.global_batch % per:
                raise ConfigError(f"global batch {self.global_batch} is not divisible by dp x microbatches "
                                  f"= {self.dp} x {self.microbatches} = {per}")
            self.micro_batch_size = self.global_batch // per
        if self.model is not None and ":" not in self.model:
            raise ConfigError(f"--model {self.model!r} must look like 'package.module:factory'")

    def resolved_pp(self, world_size: int) -> int:
        """Pipeline stages across ranks; checks pp x dp against the world size."""
        pp = self.pp if self.pp is not None else world_size // self.dp
        if pp < 1 or pp * self.dp != world_size:
            shown = self.pp if self.pp is not None else "world/dp"
            raise ConfigError(f"grid does not fit: pp={shown} x dp={self.dp} = {max(pp, 0) * self.dp} "
                              f"!= world size {world_size}")
        return pp

    def total_stages(self, world_size: int) -> int:
        return self.resolved_pp(world_size) * self.stages

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
