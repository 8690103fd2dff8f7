"""The run's configuration: one frozen dataclass whose fields carry their command-line facts.

Each field's `Flag` (its metadata) names the `--help` group, the help text, the choice list and the bounds;
launch/cli.py builds the parser by walking the fields, `__post_init__` checks values from the same facts, and
`to_dict` is the --json record's "config". Checks that need no process group run here, so every rank rejects a bad
configuration with the same one-line `ConfigError` before anything can hang.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from peerline.choices import (
    ALLOCATORS,
    ALLREDUCE_PRIORITIES,
    DATA_SOURCES,
    DEFAULT_ZB_ORDER,
    DEVICES,
    DTYPES,
    GRAD_SYNCS,
    KERNEL_IMPLEMENTATIONS,
    KERNELS,
    LOSSES,
    MODELS,
    P2P,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    STAGINGS,
    TOKEN_DATA,  # noqa: F401 - re-exported
    ZB_MEMORY,
    ZB_ORDERS,
)

#: The `--help` groups, in the order they are shown.
GRID, BATCH, MODEL, EXECUTION, OUTPUT, FAILURES = (
    "grid", "schedule and batch", "model", "execution", "output", "failures and checkpoints")
GROUPS = (GRID, BATCH, MODEL, EXECUTION, OUTPUT, FAILURES)

MAX_INT = 2**31 - 1  # an int flag without its own maximum (sizes, counts): beyond it only overflows
MAX_BUCKET_MB = 1024.0 * 1024  # 1 TiB
MAX_TIMEOUT_S = 7 * 86400.0  # a week; larger values overflow the process group's timedelta
#: The shortest --timeout-s: the deadline also covers the start of training (the first iteration's hooks, the first
#: handoffs), which a healthy CPU rank may take a good part of a second for; 0.001 s ended healthy runs.
MIN_TIMEOUT_S = 1.0


class ConfigError(ValueError):
    """A user error: printed as one line `peerline: error: <message>`, exit code 2, on every rank."""


class ReportedElsewhere(ConfigError):
    """A user error another rank has and prints: this rank exits 2 without a line of its own."""


@dataclass(frozen=True, slots=True)
class Flag:
    """The command-line facts of one RunConfig field (its flag is `--<name with dashes>`).

    group: the `--help` group; help: argparse help (may use %(default)s); choices: allowed values; short: an
    alias such as '-m'; metavar: the value's name in --help; minimum, maximum: checked by RunConfig (None values
    pass; an int without a maximum must fit 32 bits, a float must be finite); switch: a bool field given as a
    plain on-switch instead of --x/--no-x; env: an override (peerline/overrides.py)
    that replaces the field's default on the command line."""

    group: str
    help: str
    choices: tuple[str, ...] | None = None
    short: str | None = None
    metavar: str | None = None
    minimum: int | None = None
    maximum: float | None = None
    switch: bool = False
    env: str | None = None


def option(default: Any, group: str, help: str, **facts: Any) -> Any:
    """A RunConfig field with its `Flag` as metadata."""
    return dataclasses.field(default=default, metadata={"flag": Flag(group, help, **facts)})


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig:
    pp: int | None = option(None, GRID, "pipeline stages across ranks (default: world size / dp)", minimum=1)
    """Pipeline stages across ranks (default: the world size divided by dp)."""
    dp: int = option(1, GRID, "data-parallel replicas (default: %(default)s)", minimum=1)
    """Data-parallel replicas of the whole pipeline."""
    stages: int = option(1, GRID, "stages per rank: on one device as separate streams (pp=1), or placed over the "
                         "ranks by --schedule interleaved or zb-interleaved (rank r holds r, r+pp, ...) or zbv "
                         "(2: r and 2pp-1-r) (default: %(default)s)", minimum=1)
    """Stages per rank: streams of one device (pp=1), or placed by the interleaved / zb-interleaved / zbv
    schedules."""
    schedule: str = option("1f1b", BATCH, "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b "
                           "(one forward, one backward: less activation memory), zb-h1 (zero bubble: the "
                           "backward split into input and weight gradients, these deferred into the bubbles), "
                           "interleaved (1F1B over --stages V stages per rank; M a multiple of pp), zbv (zero "
                           "bubble, two stages per rank in a V; --stages 2) or zb-interleaved (zero bubble over "
                           "interleaved's --stages V stages per rank: a shorter warm-up for V times the transfers; "
                           "measured slower than zbv: see README) (default: %(default)s)",
                           choices=SCHEDULES)
    """Pipeline schedule: gpipe, 1f1b, zb-h1, interleaved, zbv or zb-interleaved."""
    zb_memory: str = option("fast", BATCH, "what a zero-bubble schedule (zb-h1, zbv, zb-interleaved) may hold: "
                            "fast (up to pp deferred weight passes per stage on top of 1F1B's microbatches: the "
                            "fewest bubbles) or 1f1b (at most 1F1B's microbatches, deferred weight passes counted: "
                            "1F1B's peak activation memory; a few percent slower: zb-h1 leaves some bubbles unfilled; "
                            "the placed schedules' orders are planned with B longer than W); zbv's default order "
                            "(--zb-order paper) holds 1F1B's memory either way (default: %(default)s)",
                            choices=ZB_MEMORY)
    """Zero-bubble memory: fast, or 1f1b (a deferred W counts as a held microbatch; pipeline/timed.py)."""
    zb_order: str = option(DEFAULT_ZB_ORDER, BATCH, "the rank orders of zbv and zb-interleaved: paper (zbv: the "
                           "zero-bubble paper's order, as torch's ScheduleZBVZeroBubble runs it, at 1F1B's memory "
                           "whatever --zb-memory says; the fastest measured on GPUs; zb-interleaved runs its list "
                           "order), list (list scheduling in unit time; with --zb-memory fast, zbv's order that holds "
                           "the most) or searched (a local search of the list order for B longer than W and a "
                           "transfer time; a few seconds at start-up): docs/TUNING.md (default: %(default)s)",
                           choices=ZB_ORDERS)
    """Rank orders of the placed zero-bubble schedules: list, searched or paper (pipeline/order_search.py)."""
    microbatches: int = option(4, BATCH, "microbatches per iteration and replica (default: %(default)s)",
                               short="-m", minimum=1)
    """Microbatches per iteration and replica (M)."""
    micro_batch_size: int = option(2, BATCH, "sequences per microbatch (default: %(default)s)", minimum=1)
    """Sequences per microbatch."""
    global_batch: int | None = option(None, BATCH, "sequences per iteration over all replicas (sets "
                                      "--micro-batch-size; must divide by dp x microbatches)", minimum=1)
    """Sequences per iteration over all replicas; when given, micro_batch_size = global_batch / (dp * M)."""
    seq: int = option(64, BATCH, "tokens per sequence (default: %(default)s)", minimum=1)
    """Tokens per sequence."""
    hidden: int = option(128, MODEL, "hidden size (default: %(default)s)", minimum=1)
    """Hidden size of the default model."""
    layers: int = option(8, MODEL, "blocks of the model: residual MLP blocks, GPT blocks, or passed to a user factory "
                         "(default: %(default)s)", minimum=1)
    """Residual MLP blocks of the default model."""
    model: str | None = option(None, MODEL, "gpt (a decoder-only LM sized by --layers --hidden --heads --seq "
                               "--vocab), or a user model 'pkg.module:factory' returning an nn.Sequential, a list of "
                               "nn.Modules or a list of per-layer builders; the factory gets the keyword arguments it "
                               "names of vocab_size (or vocab), hidden, seq, heads, layers, seed, micro_batch_size "
                               "(default: the residual-MLP model)")
    """None: the residual-MLP model; gpt: the decoder-only LM of models/gpt.py; or 'pkg.module:factory'. A factory
    may name keyword arguments (vocab_size, vocab, hidden, seq, heads, layers, seed, micro_batch_size) and gets
    their run values; it returns an nn.Sequential or a list of nn.Modules (every rank builds it whole) or a list of
    builders, callables returning one layer each (every rank builds only its own layers, each under its own seed).
    Its first layer receives floats [B, T, hidden] with --data seeded/counter, int64 token ids [B, T] with token
    data; its last layer's output is scored by --loss against the targets (floats [B, T, hidden] or token ids
    [B, T])."""
    heads: int = option(4, MODEL, "attention heads of --model gpt (default: %(default)s)", minimum=1)
    """Attention heads of the GPT; must divide --hidden into heads of an even width (RoPE)."""
    vocab: int | None = option(None, MODEL, "vocabulary size (default: the token data's; 4096 with synthetic data)",
                               minimum=2)
    """Vocabulary of the model: by default the token data's (a tokenizer of this size is trained on a text
    corpus), 4096 with synthetic data."""
    loss: str | None = option(None, MODEL, "mse, cross-entropy or 'pkg.module:fn' (fn(output, target) -> mean "
                              "loss; default: cross-entropy for token data, mse otherwise)")
    """The last stage's loss: mse (fp32, against float targets), cross-entropy (logits [B, T, V] against token
    labels [B, T]), or 'pkg.module:fn' called as fn(output, target) -> a scalar mean loss. Default: cross-entropy
    with token data (text, a PATH, a user feed), mse with synthetic data."""
    tie_embeddings: bool = option(False, MODEL, "tie the GPT's LM head to its token embedding (gradients summed "
                                  "across the first and last stage)", switch=True)
    """The GPT's LM head shares the token embedding's weight: both start equal and their gradients are summed
    before every optimizer step (across the first and last stage's ranks, or on one rank)."""
    recompute: str = option("off", MODEL, "activation recomputation: off, full (every layer) or N (the first N "
                            "layers of each stage; default: %(default)s)", metavar="off|full|N")
    """Activation recomputation per layer (torch.utils.checkpoint): off, full, or N = the first N layers of every
    stage (early stages of 1F1B hold the most activations in flight)."""
    seed: int = option(0, MODEL, "seed of the weights and of the data sampling (default: %(default)s)", minimum=0,
                       maximum=2**32 - 1)
    """Seed of the weights and of the synthetic data."""
    iters: int = option(5, EXECUTION, "iterations from the start of training (default: %(default)s)", minimum=1)
    """Iterations counted from the start of training (a resumed run continues up to this number)."""
    lr: float = option(1e-3, MODEL, "AdamW learning rate (default: %(default)s)", maximum=100.0)
    """AdamW learning rate."""
    device: str = option("auto", EXECUTION, "default: $PEERLINE_DEVICE, else auto (CUDA when available)",
                         choices=DEVICES, env="PEERLINE_DEVICE")
    """auto (CUDA when available), cuda, or cpu."""
    dtype: str | None = option(None, EXECUTION, "compute dtype: bf16 (default on GPU) or fp32 (default on CPU)",
                               choices=DTYPES)
    """The compute dtype: bf16 (default on GPU; bf16 weights, or autocast over fp32 weights with --precision
    autocast) or fp32 (default on CPU)."""
    precision: str = option("master", EXECUTION, "where weights, gradients and AdamW state live: master (with "
                            "bf16 compute: bf16 weights and gradients, fp32 master weights and AdamW moments in the "
                            "optimizer, no autocast; with --dtype fp32: all fp32), autocast (fp32 weights, gradients "
                            "and state; with --dtype bf16 the compute runs under bf16 autocast), bf16 (bf16 weights, "
                            "gradients and state, no autocast; needs --dtype bf16) or compact (the model as bf16; the "
                            "optimizer keeps exact fp32 masters as int16 remainders and bf16 moments: 10 bytes per "
                            "parameter; needs --dtype bf16, no --shard-optimizer) (default: %(default)s)",
                            choices=PRECISIONS)
    """master: with bf16 compute the model of the bf16 recipe (bf16 parameters and gradients, the GEMMs read the
    weights as they are, no autocast) and grad_sync/master_adamw.py's optimizer, which keeps an fp32 master copy of
    every parameter and fp32 AdamW moments (16 bytes per parameter); with --dtype fp32 fp32 parameters, gradients
    and AdamW state. autocast: fp32 parameters, gradients and AdamW state (16 bytes per parameter, and a bf16 copy
    of each weight per iteration), bf16 compute by autocast where --dtype bf16 (torch's AMP recipe). bf16:
    parameters, gradients and AdamW moments in bf16 (8 bytes per parameter), the model runs in bf16 throughout
    (residual stream, LayerNorm outputs with fp32 statistics, stage boundaries). compact: the model as bf16; the
    optimizer (grad_sync/compact_adamw.py) keeps each parameter's fp32 master weight exactly, as an int16 remainder
    beside the bf16 parameter, and AdamW's moments in bf16 (10 bytes per parameter): Transformer Engine's
    FusedAdam with store_param_remainders. docs/PRECISION.md compares the recipes."""
    kernels: str = option("auto", EXECUTION, "elementwise kernels (default: %(default)s = peerline on GPU, torch "
                          "on CPU)", choices=KERNELS)
    """Elementwise kernels: peerline (warp-specialized CUDA), torch, or auto (peerline on GPU)."""
    p2p: str = option("auto", EXECUTION, "stage-to-stage transport (default: %(default)s = copy engine between "
                      "GPUs of a host)", choices=P2P)
    """Stage-to-stage transport: copy-engine, nccl (gloo on CPU), or auto."""
    p2p_lanes: int = option(2, EXECUTION, "copy-engine send streams (default: %(default)s, messages round robin)")
    """Send streams of the copy-engine transport (2: messages round robin over two lanes)."""
    p2p_split: bool = option(False, EXECUTION, "copy-engine: copy each message's halves on two lanes at once "
                             "(default: off)")
    """Copy-engine transport: each message's halves copied at once by two lanes (needs an even --p2p-lanes)."""
    p2p_decoupled: bool = option(False, EXECUTION, "copy-engine: flags on the last two lanes, copies alone on the "
                                 "others (default: off)")
    """Copy-engine transport: the last two lanes carry the FREE / FULL flags, the others only copies (--p2p-lanes
    >= 3, not with --p2p-split)."""
    graph: bool | None = option(None, EXECUTION, "capture each iteration into a CUDA graph (default: on for GPUs)")
    """Capture each iteration into a CUDA graph (default on GPU; ignored on the CPU)."""
    warmup_iters: int = option(3, EXECUTION, "eager iterations before graph capture (default: %(default)s)",
                               minimum=1)
    """Eager iterations before a CUDA graph is captured."""
    graph_loop: int = option(1, EXECUTION, "iterations per host launch of the graph: K > 1 loops the captured "
                             "iteration on the device, the host launching once per K iterations (default: "
                             "%(default)s; --log-every then defaults to K)", metavar="K", minimum=1)
    """Iterations per host launch of the graph: K > 1 replays the captured iteration K times from one launch (a
    WHILE node on the device, the K iterations' data staged on the device first: cudagraph/loop.py), so the host's
    launch cost is paid once per K iterations. Needs --log-every a multiple of K (launches also end at --save-every
    checkpoints); a graph that cannot be looped (copy-engine flags between GPUs) replays one iteration per
    launch, with a notice."""
    grad_sync: str = option("buckets", EXECUTION, "data-parallel gradient average (default: %(default)s)",
                            choices=GRAD_SYNCS)
    """Data-parallel gradient average: buckets (bucketed all-reduce overlapped with backward) or per-param."""
    bucket_mb: float = option(25.0, EXECUTION, "gradient bucket size of the data-parallel all-reduce, MiB "
                              "(default: %(default)s)", maximum=MAX_BUCKET_MB)
    """Gradient bucket size for the data-parallel all-reduce, MiB."""
    first_bucket_mb: float = option(1.0, EXECUTION, "size of the first bucket (the last layers), MiB, so the "
                                    "all-reduce starts early (default: %(default)s)", maximum=MAX_BUCKET_MB)
    """Size of the first (last-layer) bucket, MiB, so the all-reduce starts early."""
    shard_optimizer: bool = option(False, EXECUTION, "ZeRO-1 over the dp group: gradients reduce-scattered, AdamW "
                                   "state and update on each rank's shard only, parameters all-gathered after the "
                                   "step (optimizer memory / dp; a notice and no effect with dp=1)", switch=True)
    """ZeRO-1 (grad_sync/sharded.py): each bucket's gradient is reduce-scattered over the dp group instead of
    all-reduced, AdamW keeps fp32 state for and updates only this rank's shard of every bucket, and the updated
    shards are all-gathered into the parameters after the step; all of it inside the captured graph. Optimizer
    memory per rank falls by about dp. With --precision master and bf16 compute the shards are bf16 and the
    optimizer keeps fp32 masters and moments of its shards (sharded_adamw.py's ShardedMasterAdamW). Needs
    --grad-sync buckets; not with --tie-embeddings or --precision compact; with dp=1 it does nothing (a notice
    says so)."""
    overlap_param_gather: bool = option(False, EXECUTION, "with --shard-optimizer: each bucket's all-gather of the "
                                        "updated parameters runs beside the next iteration's forward, which waits for "
                                        "it only before the first layer that reads the bucket (default: off: at the "
                                        "GPT compute shape, pp=1 x dp=2 on H200, the plain sharded step was faster, "
                                        "309 against 312 ms)", switch=True)
    """With --shard-optimizer (grad_sync/param_gather.py): the all-gathers of the updated shards are not waited for
    at the end of the step; they start the next iteration on the all-reduce stream, in the order the forward reads
    the buckets, and the compute stream waits for one bucket before the first layer that reads it. Inside the
    captured graph too. Checkpoints, checksums and the end of training gather first. Off by default until measured
    on GPUs (goal: a sharded step within 3% of the unsharded one)."""
    nccl_max_ctas: int | None = option(16, EXECUTION, "cap on the CTAs (SMs) of the dp group's NCCL all-reduce "
                                       "kernels, 0 = NCCL's default (default: %(default)s, measured on H200; see "
                                       "docs/benchmarks)")
    """Cap on the CTAs (SMs) of the dp group's NCCL kernels (bucket all-reduces overlapped with backward); 0 or
    None: NCCL's default. The buckets of the stage's first layer, which nothing is left to overlap, run on an
    uncapped twin group (Mesh.dp_tail_group). 16 leaves backward its SMs and exposes less all-reduce after it than
    NCCL's default; docs/benchmarks has the measurements."""
    allreduce_priority: str = option("highest", EXECUTION, "all-reduce stream priority: highest (a ready bucket is "
                                     "not queued behind backward) or normal (as DDP's), for comparison; graphs "
                                     "ignore stream priorities (default: %(default)s)", choices=ALLREDUCE_PRIORITIES)
    """Priority of the all-reduce stream: highest (the device's highest, so a ready bucket's all-reduce is not
    queued behind backward kernels) or normal (as DDP's NCCL stream), for comparison. Eager iterations only: a
    CUDA graph launched as torch instantiates it ignores the priorities of the streams it was captured from."""
    timeout_s: float = option(300.0, EXECUTION, "deadline on progress: a rank that completes no handoff, "
                              "collective or iteration for this many seconds ends the job naming the rank that "
                              "stopped; also the start-up rendezvous deadline (at least 1; default: %(default)s)",
                              maximum=MAX_TIMEOUT_S)
    """Deadline on progress: the watchdog ends a rank that completes no handoff, collective or iteration for this
    long (a long iteration of quick handoffs is never cut); also the start-up rendezvous and the process-group
    timeout (a little longer, so the watchdog's line comes first)."""
    log_every: int | None = option(None, OUTPUT, "read the loss back every N iterations (default: 1, or K with "
                                   "--graph-loop K)", minimum=1)
    """Read the loss back (one host sync) every N iterations; None: once per graph launch (1, or graph_loop)."""
    json: str | None = option(None, OUTPUT, "write config, losses, timings and versions to this file (rank 0)",
                             metavar="PATH")
    """Write config, losses, timings and versions to this JSON file (rank 0)."""
    timeline: str | None = option(None, OUTPUT, "write a timeline of the last iteration: PATH.png and PATH.json",
                                 metavar="PATH")
    """Write a timeline (PNG + Chrome trace) of the last iteration with this path stem."""
    tensorboard: str | None = option(None, OUTPUT, "write TensorBoard event files (loss, ms/iter, tokens/s, "
                                     "TFLOP/s, MFU, peak memory per logged iteration) to DIR (rank 0; needs the "
                                     "[tensorboard] extra)", metavar="DIR")
    """Folder of TensorBoard event files, one scalar per metric and logged iteration (rank 0)."""
    metrics_jsonl: str | None = option(None, OUTPUT, "write one JSON line per logged iteration (the same metrics) to "
                                       "PATH, flushed each line (rank 0; a resumed run appends)", metavar="PATH")
    """File of one JSON object per logged iteration, flushed line by line (rank 0; a resumed run appends)."""
    profile: str | None = option(None, OUTPUT, "write a torch.profiler trace (Chrome / TensorBoard format) of 3 "
                                 "iterations after warm-up to DIR/rank<k> on every rank; the run is eager (CUDA "
                                 "graphs off: a profile of graph replays shows one launch per iteration)",
                                 metavar="DIR")
    """Folder of torch.profiler traces, one sub-folder per rank, of a few eager iterations after warm-up (CUDA
    graphs are off: a replayed graph shows as one launch). Implies nvtx."""
    nvtx: bool = option(False, OUTPUT, "NVTX ranges around every forward, backward, send and receive, for Nsight "
                        "Systems (GPU; eager iterations: a graph replay runs no host code)", switch=True)
    """NVTX ranges (GPU only) around each step of the schedule, named by stage and step, so Nsight Systems shows the
    stages; nothing is called when off."""
    data: str | None = option(None, EXECUTION, "seeded or counter (synthetic floats), text (the Python standard "
                              "library's source, tokenized once), PATH (a folder of text files or a .bin token "
                              "file), or 'pkg.module:fn' (a user token feed; see the README) (default: text with "
                              "--model gpt, seeded otherwise)", metavar="SOURCE")
    """The data. Synthetic floats [B, T, hidden]: seeded (torch's generator reseeded per iteration and microbatch
    on the host) or counter (a hash of (seed, iteration, microbatch, element) made on the device from an iteration
    counter, inside the CUDA graph; data/counter.py). Token ids [B, T] (inputs on the first stage, next-token
    labels on the last; data/token_feed.py): text (the default corpus), a PATH (a folder of text files, one text
    file, or a nanoGPT-style .bin token file), or 'pkg.module:fn', a factory called with the keyword arguments it
    names of seq, micro_batch_size, seed, vocab_size and returning fill(inputs, labels, iteration, global_mb) (a
    function, or an object with that method) that writes int64 [B, T] tensors in place."""
    data_cache: str | None = option(None, EXECUTION, "where text is tokenized to (default: ~/.cache/peerline/text)",
                                    metavar="DIR")
    """Folder of the tokenizer and token-file cache of text data (default: ~/.cache/peerline/text)."""
    staging: str = option("direct", EXECUTION, "inputs/results: direct, or pinned (host ring + h2d/d2h streams; "
                          "default: %(default)s)", choices=STAGINGS)
    """Inputs and results: direct (generated on the device into the static buffers) or pinned (generated on the
    host, equal to the CPU's data, staged through a ring of pinned slots on the h2d stream; per-microbatch losses
    back on the d2h stream: memory/staging.py)."""
    allocator: str | None = option(None, EXECUTION, "device allocator: caching or async (cudaMallocAsync; default: "
                                   "$PEERLINE_ALLOCATOR, else the backend PYTORCH_CUDA_ALLOC_CONF selects)",
                                   choices=ALLOCATORS, env="PEERLINE_ALLOCATOR")
    """Device allocator: caching (PyTorch's) or async (cudaMallocAsync pool); chosen before torch loads. None: the
    one the environment chose (PYTORCH_CUDA_ALLOC_CONF; caching unless it names cudaMallocAsync)."""
    pool_release_threshold: int | None = option(None, EXECUTION, "bytes the async pool keeps across "
                                                "synchronizations (default: all)", maximum=2**63 - 1)
    """Bytes the async allocator's pool keeps across synchronizations (default: all of it)."""
    save: str | None = option(None, FAILURES, "write checkpoints to DIR (checked for writing before training)",
                              metavar="DIR")
    """Directory the checkpoints are written to."""
    save_every: int = option(0, FAILURES, "checkpoint every N iterations (default: only at the end)", metavar="N",
                             minimum=0)
    """Checkpoint every N iterations; 0: only at the end (needs save)."""
    resume: str | None = option(None, FAILURES, "continue from the newest checkpoint in DIR (on any grid: pp, dp "
                                "and schedule may differ; the model's shape must match); the run still ends at "
                                "--iters, counted from the start of training", metavar="DIR")
    """Directory whose newest checkpoint the run continues from."""
    skip_nonfinite: bool = option(False, FAILURES, "skip the optimizer step of an iteration with a NaN/inf loss "
                                  "(on every rank) instead of stopping", switch=True)
    """Skip the optimizer step of an iteration whose loss is NaN/inf (on every rank) instead of stopping."""
    max_loss_growth: float = option(1000.0, FAILURES, "stop the run (one line, exit 1) when a logged loss exceeds "
                                    "this many times the first logged one: a diverging run (--lr too high) ends "
                                    "instead of training on; a NaN/inf loss always stops it (see --skip-nonfinite); "
                                    "0: off (default: %(default)s)", metavar="F", maximum=1e300)
    """Divergence guard (resilience/nonfinite.py): a logged loss above this factor times the run's first logged
    loss stops every rank with one line and exit 1; 0 turns it off."""
    keep: int | None = option(None, FAILURES, "keep only the newest N checkpoints in --save DIR (default: all)",
                              metavar="N", minimum=1)
    """Checkpoints kept in the save directory: older ones are deleted after each complete save (None: all)."""
    save_async: bool = option(False, FAILURES, "write each checkpoint in the background: the state is copied to "
                              "host memory (pinned on a GPU) at the iteration boundary and written while training "
                              "goes on, as atomic and verified as a synchronous save; a write in flight is waited "
                              "for at the next save and at the end (default: off, until measured on GPUs; it keeps "
                              "a host copy of each rank's state for the run)")
    """Write checkpoints in the background (resilience/async_checkpoint.py): staged to host memory at the boundary,
    written by a thread on a gloo group of its own while training goes on."""
    preempt_signals: str = option("TERM,USR1,INT", FAILURES, "signals that stop the job at the next iteration "
                                  "boundary, every rank agreeing, after a checkpoint (with --save); exit 75 "
                                  "(default: %(default)s; none: off)", metavar="SIGS")
    """Signals that preempt the run (resilience/preemption.py): comma-separated names, or none."""
    preempt_check_every: int = option(1, FAILURES, "iterations between the ranks' preemption agreements (a host "
                                      "barrier through the c10d store; default: %(default)s)", metavar="N",
                                      minimum=1)
    """Iterations between the ranks' agreement rounds on a preemption signal (launch boundaries only)."""

    def __post_init__(self) -> None:
        _resolve_workload(self)
        _check_flags(self)
        _check_workload(self)
        _check_transport(self)
        _check_graph_loop(self)
        _check_memory(self)
        _check_numbers(self)
        _derive_batch(self)
        if self.save_every and not self.save:
            raise ConfigError("--save-every needs --save DIR")
        _check_checkpointing(self)
        _check_sharding(self)
        _check_precision(self)

    def resolved_pp(self, world_size: int) -> int:
        """Pipeline stages across ranks; checks pp x dp against the world size."""
        pp = self.pp if self.pp is not None else world_size // self.dp
        if pp < 1 or pp * self.dp != world_size:
            shown = self.pp if self.pp is not None else "world/dp"
            raise ConfigError(f"grid does not fit: pp={shown} x dp={self.dp} = {max(pp, 0) * self.dp} "
                              f"!= world size {world_size}")
        return pp

    @property
    def token_data(self) -> bool:
        """Token ids (text, a PATH, a user feed) rather than synthetic floats (seeded, counter)."""
        return self.data not in DATA_SOURCES

    @property
    def recompute_layers(self) -> int | None:
        """Layers recomputed at the start of every stage: None for all (full), 0 for none (off)."""
        if self.recompute == "full":
            return None
        return 0 if self.recompute == "off" else int(self.recompute)

    def total_stages(self, world_size: int) -> int:
        return self.resolved_pp(world_size) * self.stages

    def to_dict(self) -> dict[str, object]:
        """Every field by name (flat, in declaration order): the --json record's "config"."""
        return dataclasses.asdict(self)


def flags() -> Iterator[tuple[dataclasses.Field, Flag]]:
    """Every RunConfig field with its Flag, in declaration order."""
    for f in dataclasses.fields(RunConfig):
        yield f, f.metadata["flag"]


def flag_name(field_name: str) -> str:
    """The command-line flag of a field: 'micro_batch_size' -> '--micro-batch-size'."""
    return "--" + field_name.replace("_", "-")


def _check_flags(cfg: RunConfig) -> None:
    """Choice lists and lower bounds, from each field's Flag (None values are left to their defaults)."""
    for f, flag in flags():
        value = getattr(cfg, f.name)
        if value is None:
            continue
        if flag.choices is not None and value not in flag.choices:
            raise ConfigError(f"unknown {f.name.replace('_', ' ')} {value!r}; choose one of "
                              f"{', '.join(flag.choices)}")
        _check_range(f.name, flag, value)


def _check_range(name: str, flag: Flag, value: object) -> None:
    """A number within its field's bounds; NaN and infinities fail (they pass every `<= 0` test)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{flag_name(name)} must be a finite number, got {value}")
    if flag.minimum is not None and value < flag.minimum:
        raise ConfigError(f"{flag_name(name)} must be >= {flag.minimum}, got {value}")
    maximum = flag.maximum if flag.maximum is not None else (MAX_INT if isinstance(value, int) else None)
    if maximum is not None and value > maximum:
        shown = f"{maximum:g}" if isinstance(maximum, float) else str(maximum)
        raise ConfigError(f"{flag_name(name)} must be <= {shown}, got {value:g}" if isinstance(value, float)
                          else f"{flag_name(name)} must be <= {shown}, got {value}")


def is_spec(value: str) -> bool:
    """'package.module:name' (a user model, feed or loss), as opposed to a built-in name or a path."""
    module, sep, attr = value.partition(":")
    return bool(sep) and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))


def _resolve_workload(cfg: RunConfig) -> None:
    """Defaults that follow the model and the data (set once, here: the config is frozen)."""
    if cfg.data is None:
        object.__setattr__(cfg, "data", "text" if cfg.model == "gpt" else "seeded")
    if cfg.loss is None:
        object.__setattr__(cfg, "loss", "cross-entropy" if cfg.token_data else "mse")


def _check_workload(cfg: RunConfig) -> None:
    """The model, data, loss and recomputation fit each other."""
    if cfg.model is not None and cfg.model not in MODELS and not is_spec(cfg.model):
        raise ConfigError(f"--model {cfg.model!r} must be {' or '.join(MODELS)} or look like 'package.module:factory'")
    if cfg.loss not in LOSSES and not is_spec(cfg.loss):
        raise ConfigError(f"--loss {cfg.loss!r} must be {', '.join(LOSSES)} or look like 'package.module:fn'")
    if cfg.recompute not in RECOMPUTE and not cfg.recompute.isdigit():
        raise ConfigError(f"--recompute must be off, full or a number of layers N >= 0, got {cfg.recompute!r}")
    if cfg.data is not None and not cfg.data.strip():
        raise ConfigError("--data is empty: name the data (seeded, counter, text, a PATH such as . for this folder, "
                          "or 'pkg.module:fn')")
    if cfg.model == "gpt":
        if cfg.hidden % cfg.heads or (cfg.hidden // cfg.heads) % 2:
            raise ConfigError(f"--heads {cfg.heads} must divide --hidden {cfg.hidden} into heads of an even width "
                              "(RoPE rotates pairs of dimensions)")
        if not cfg.token_data:
            raise ConfigError(f"--model gpt reads token ids: --data {cfg.data} makes floats; use --data text, a PATH "
                              "or 'pkg.module:fn'")
    if cfg.tie_embeddings and cfg.model != "gpt":
        raise ConfigError("--tie-embeddings needs --model gpt")
    if cfg.loss == "mse" and cfg.token_data:
        raise ConfigError(f"--loss mse needs float targets: --data {cfg.data} gives token labels")
    if cfg.loss == "cross-entropy" and not cfg.token_data:
        raise ConfigError(f"--loss cross-entropy needs token labels: --data {cfg.data} makes floats")
    if cfg.token_data and cfg.staging != "direct":
        raise ConfigError("--staging pinned applies to synthetic data: token data is staged through pinned host "
                          "memory already")
    if cfg.token_data and cfg.graph_loop > 1:
        raise ConfigError(f"--graph-loop needs --data seeded or counter (made on the device), got --data {cfg.data}")


def _check_transport(cfg: RunConfig) -> None:
    if cfg.p2p_lanes < 1 or (cfg.p2p_split and cfg.p2p_lanes % 2):
        raise ConfigError(f"--p2p-lanes must be >= 1 (and even with --p2p-split), got {cfg.p2p_lanes}")
    if cfg.p2p_decoupled and (cfg.p2p_split or cfg.p2p_lanes < 3):
        raise ConfigError(f"--p2p-decoupled needs --p2p-lanes >= 3 and no --p2p-split, got {cfg.p2p_lanes}")
    if cfg.nccl_max_ctas is not None and not 0 <= cfg.nccl_max_ctas <= 64:
        raise ConfigError(f"--nccl-max-ctas must be in 0..64 (0: NCCL's default), got {cfg.nccl_max_ctas}")


def _check_graph_loop(cfg: RunConfig) -> None:
    """Looped launches read the loss once per launch and need the data already on the device."""
    if cfg.log_every is None:  # not given: read the loss once per looped launch
        object.__setattr__(cfg, "log_every", cfg.graph_loop)
    if cfg.graph_loop > 1 and cfg.log_every % cfg.graph_loop:
        raise ConfigError(f"--graph-loop {cfg.graph_loop} runs {cfg.graph_loop} iterations per launch: "
                          f"--log-every must be a multiple of it, got {cfg.log_every}")
    if cfg.graph_loop > 1 and cfg.staging != "direct":
        raise ConfigError("--graph-loop needs --staging direct (the looped iterations read data staged on the "
                          "device)")


def _check_memory(cfg: RunConfig) -> None:
    if cfg.data == "counter" and cfg.staging != "direct":
        raise ConfigError("--data counter makes the data on the device: it needs --staging direct")
    if cfg.pool_release_threshold is not None:
        if cfg.allocator == "caching":
            raise ConfigError("--pool-release-threshold applies to --allocator async only")
        if cfg.pool_release_threshold < 0:
            raise ConfigError(f"--pool-release-threshold must be >= 0 bytes, got {cfg.pool_release_threshold}")


def _check_numbers(cfg: RunConfig) -> None:
    if cfg.bucket_mb <= 0 or cfg.first_bucket_mb <= 0:
        raise ConfigError("--bucket-mb and --first-bucket-mb must be positive")
    if cfg.timeout_s < MIN_TIMEOUT_S:
        raise ConfigError(f"--timeout-s {cfg.timeout_s:g} is too short: the deadline must be at least "
                          f"{MIN_TIMEOUT_S:g} s (it bounds the start-up rendezvous and every handoff, collective and "
                          "iteration, the first included: a shorter one ends healthy runs, blaming ranks that are "
                          "only slow)")
    if cfg.max_loss_growth != 0 and not cfg.max_loss_growth > 1:
        raise ConfigError(f"--max-loss-growth must be above 1 (or 0: off), got {cfg.max_loss_growth:g}")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {cfg.lr}")


def _check_checkpointing(cfg: RunConfig) -> None:
    """--keep and --save-async need --save; --preempt-signals names catchable signals."""
    if cfg.keep is not None and not cfg.save:
        raise ConfigError("--keep needs --save DIR")
    if cfg.save_async and not cfg.save:
        raise ConfigError("--save-async needs --save DIR")
    names = [] if cfg.preempt_signals.strip().lower() in ("", "none") else cfg.preempt_signals.split(",")
    for name in names:
        full = "SIG" + name.strip().upper().removeprefix("SIG")
        if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"--preempt-signals: {name.strip()!r} is not a signal that can be caught; use names "
                              "such as TERM,USR1,INT, or none")


def _check_sharding(cfg: RunConfig) -> None:
    """--shard-optimizer shards the bucketed gradients; the tied weights' sum needs whole gradients;
    --overlap-param-gather overlaps the sharded step's all-gather."""
    if cfg.shard_optimizer and cfg.grad_sync != "buckets":
        raise ConfigError(f"--shard-optimizer needs --grad-sync buckets, got --grad-sync {cfg.grad_sync}")
    if cfg.overlap_param_gather and not cfg.shard_optimizer:
        raise ConfigError("--overlap-param-gather needs --shard-optimizer (it overlaps the sharded step's parameter "
                          "all-gather with the next forward; unsharded runs have no such all-gather)")
    if cfg.shard_optimizer and cfg.tie_embeddings:
        raise ConfigError("--shard-optimizer does not support --tie-embeddings yet (the tied gradients are summed "
                          "after the gradient sync, which leaves only a shard of them)")


def _check_precision(cfg: RunConfig) -> None:
    """--precision bf16 and compact keep the weights in bf16: the compute is bf16 too. compact's optimizer keeps
    whole parameters' remainders: it does not shard them (yet)."""
    if cfg.precision in ("bf16", "compact") and cfg.dtype == "fp32":
        raise ConfigError(f"--precision {cfg.precision} keeps the weights in bf16 and needs --dtype bf16 (the default "
                          "on a GPU), not --dtype fp32")
    if cfg.precision == "compact" and cfg.shard_optimizer:
        raise ConfigError("--precision compact does not support --shard-optimizer yet (its optimizer keeps every "
                          "parameter's master remainder and moments whole); use --precision master with it")


def _derive_batch(cfg: RunConfig) -> None:
    """global_batch, when given, sets micro_batch_size (the config is frozen: set once, here)."""
    if cfg.global_batch is None:
        return
    per = cfg.dp * cfg.microbatches
    if cfg.global_batch % per:
        raise ConfigError(f"global batch {cfg.global_batch} is not divisible by dp x microbatches "
                          f"= {cfg.dp} x {cfg.microbatches} = {per}")
    object.__setattr__(cfg, "micro_batch_size", cfg.global_batch // per)


__all__ = ["RunConfig", "ConfigError", "ReportedElsewhere", "Flag", "GROUPS", "flags", "flag_name", "SCHEDULES",
           "DTYPES", "DEVICES",
           "KERNEL_IMPLEMENTATIONS", "KERNELS", "P2P", "GRAD_SYNCS", "ALLREDUCE_PRIORITIES", "ALLOCATORS",
           "STAGINGS", "DATA_SOURCES", "TOKEN_DATA", "MODELS", "LOSSES", "RECOMPUTE", "ZB_MEMORY", "ZB_ORDERS",
           "DEFAULT_ZB_ORDER", "is_spec"]
