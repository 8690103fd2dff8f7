"""Benchmark suite `gpt`: the GPT language model (--model gpt on the default text corpus) trained by peerline,
eager and with whole-iteration CUDA graphs, against the anchor a user would pick: a GPT of the same architecture
and FLOPs written with plain torch modules (bench/suites/plain_gpt.py) under torch.distributed.pipelining on the
same data and loss, with its fastest schedule, precision recipe and blocks (eager or torch.compile'd); pp = the
world size. A second torch row runs peerline's own GPT under torch.distributed.pipelining (its fastest schedule and
recipe, eager), recorded against the same anchor. Optionally (--gpt-recompute) the cost of activation
recomputation: peerline with --recompute off / N / full. Optionally (--gpt-single) a one-GPU row per configuration.

    torchrun --nproc_per_node=2 launch/bench.py gpt [--gpt-configs compute,launch] [--gpt-recompute]
        [--gpt-layers 24 --gpt-hidden 2048 --gpt-heads 16 --gpt-seq 2048 --gpt-mbs 1 --gpt-microbatches 8]
        [--gpt-anchor-compile both|on|off] [--gpt-single | --no-gpt-single]
    torchrun --nproc_per_node=2 launch/bench.py gpt --quick          (a tiny fp32 GPT on the CPU, gloo)

Configurations (cross-entropy on the default corpus's tokens, AdamW, peerline 1F1B):
  compute  24 blocks, hidden 2048, 16 heads, seq 2048, micro-batch 1, M=8, bf16  (the --gpt-* flags resize it)
  launch   32 blocks, hidden 256, 4 heads, seq 256, micro-batch 2, M=16, bf16   (host-launch-bound)
  quick    2 blocks, hidden 32, 2 heads, seq 16, micro-batch 2, M=4, fp32       (--quick: the CPU smoke test)

The anchor tries every torch schedule that applies (bench/suites/torch_schedules.py) under every precision recipe
(bf16 parameters; fp32 parameters + bf16 autocast; fp32 alone for fp32 shapes) with its blocks eager and compiled
(--gpt-anchor-compile; torch.compile per block as torchtitan does; not with the zero-bubble schedules, which torch
refuses to run through compiled modules; eager only on the CPU unless asked, where inductor's code generation is
slow); the fastest is the anchor, and each record's extra names it (anchor_model, anchor_schedule, anchor_recipe,
anchor_blocks) and lists every candidate's time. Records: tokens/s (extra: the model, ms/iter, achieved TFLOP/s per
GPU and MFU from models/flops.py, peak memory of every rank, the first losses of both), and MFU % where the card's
peak is known; `<configuration> torch-peerline-gpt` is peerline's GPT under torch against the plain anchor. The
recompute table: ms/iter and peak memory (max over ranks) of each setting against off.

One-GPU part (--gpt-single, off by default): per configuration, a fresh process on rank 0's GPU (the other ranks
wait; eager.py's mechanism) trains the whole plain torch GPT eager (no pipelining library; bf16 parameters, no
autocast, fused AdamW: the anchor's bf16 recipe; per microbatch forward, loss / M and backward, then one step)
against peerline --model gpt --stages 1 --no-graph --precision bf16, the same shape, microbatches, seed and tokens,
in bf16 (the quick shape too, on the CPU). Record `<configuration> one-GPU eager bf16`: tokens/s against "plain
torch GPT eager, one GPU" (pp 1); the note gives both sides' ms/iter and first losses.

Timing is the pipeline suite's (bench/runtime_timing.py): blocks of --gpt-iters iterations, the slowest rank's time,
median over --reps blocks after --warmup blocks (the one-GPU child's too). With --gpt-paired (the default) each
peerline variant of the main table is timed with the anchor's fastest candidate built again beside it, their blocks
taken in turn, and recorded against that time (extra: anchor_paired, and the search's own time as
anchor_search_ms): the search measures its compiled candidates right after their compile, on a GPU that was idle and
cooler, and a GPU at its power cap clocks lower as it warms. Peak memory stays each side's own (peerline's: the
peak of its first iterations less what the idle anchor holds). Under --isolate, where each measurement runs in a job
of its own, the variants are recorded against the search's time. Each time comes with its host lead
(benchkit.Timing.host_lead_ms): the device work still queued when the host had issued a block. An eager anchor with
a lead near 0 is host-bound, and its time follows the speed of the host it runs on, so compare such figures only
within one machine.

Every measurement goes through runtime_timing.measure_or_note, so with --isolate (bench/isolation.py) each one
(the anchor with its candidates, each peerline variant, each one-GPU row) runs as a job of its own and the others
replay its result.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch.distributed as dist

from peerline.bench.benchkit import BenchContext
from peerline.bench.runtime_timing import free_device
from peerline.bench.suites.gpt_anchor import GPTShape
from peerline.bench.suites.gpt_runs import GPTBench, one_gpu
from peerline.choices import DEFAULT_ZB_ORDER, KERNELS, ZB_MEMORY, ZB_ORDERS

CONFIGS = {
    "compute": GPTShape("compute-bound", layers=24, hidden=2048, heads=16, seq=2048, micro_batch_size=1,
                        microbatches=8, dtype="bf16"),
    "launch": GPTShape("launch-bound", layers=32, hidden=256, heads=4, seq=256, micro_batch_size=2,
                       microbatches=16, dtype="bf16"),
    "quick": GPTShape("quick", layers=2, hidden=32, heads=2, seq=16, micro_batch_size=2, microbatches=4,
                      dtype="fp32"),
}
VARIANTS = ("torch", "torch-peerline-gpt", "eager", "graph")
#: --gpt-anchor-compile -> the plain anchor's blocks tried
COMPILE = {"both": ["eager", "compiled"], "on": ["compiled"], "off": ["eager"]}
#: --gpt-* size flag -> GPTShape field (they resize the compute configuration)
SIZE_FLAGS = {"gpt_layers": "layers", "gpt_hidden": "hidden", "gpt_heads": "heads", "gpt_seq": "seq",
              "gpt_mbs": "micro_batch_size", "gpt_microbatches": "microbatches"}


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--gpt-configs", type=_csv, default=None,
                       help="comma-separated: compute, launch, quick (default compute,launch; quick with --quick)")
    for flag, name in SIZE_FLAGS.items():
        group.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, default=None,
                           help=f"the compute configuration's {name.replace('_', ' ')} (default "
                                f"{getattr(CONFIGS['compute'], name)})")
    group.add_argument("--gpt-variants", type=_csv, default=None,
                       help="torch (the plain torch GPT, the anchor), torch-peerline-gpt (peerline's GPT under "
                            "torch), eager, graph (default all)")
    group.add_argument("--gpt-schedules", type=_csv, default=None,
                       help="peerline's schedules for the eager and graph variants, e.g. 1f1b,zb-h1 (default 1f1b)")
    group.add_argument("--gpt-precisions", type=_csv, default=None,
                       help="peerline's --precision recipes for the eager and graph variants: master, autocast "
                            "(fp32 weights under bf16 autocast: torch's AMP recipe), bf16, compact, e.g. "
                            "master,autocast,bf16 (default master); each is compared with the anchor's fastest recipe")
    group.add_argument("--gpt-kernels", type=_csv, default=None,
                       help="peerline's --kernels for the eager and graph variants: auto, torch, peerline, e.g. "
                            "auto,torch: the same model with peerline's fused kernels and with torch's ops, each "
                            "compared with the anchor (default auto)")
    group.add_argument("--gpt-zb-memory", type=_csv, default=None,
                       help="peerline's --zb-memory for its zero-bubble schedules (zb-h1, zbv): fast, 1f1b, e.g. "
                            "fast,1f1b (default fast)")
    group.add_argument("--gpt-zb-orders", type=_csv, default=None,
                       help="peerline's --zb-order for zbv and zb-interleaved: list, searched, paper, e.g. list,paper "
                            f"(default {DEFAULT_ZB_ORDER}, the run's)")
    group.add_argument("--gpt-anchor-schedules", type=_csv, default=None,
                       help="the anchor's torch schedules to try: 1f1b,gpipe,interleaved-1f1b,interleaved-zb,zbv,"
                            "dualpipev (default all that apply)")
    group.add_argument("--gpt-anchor-compile", choices=list(COMPILE), default=None,
                       help="the anchor's blocks: eager and torch.compile'd (both), compiled only (on), eager only "
                            "(off); default both on a GPU, off on the CPU")
    group.add_argument("--gpt-compile-backend", default=None,
                       help="torch.compile's backend for the anchor's compiled blocks (default inductor; aot_eager "
                            "traces without generating code, for CPU tests)")
    group.add_argument("--gpt-paired", action=argparse.BooleanOptionalAction, default=True,
                       help="time each peerline variant with the anchor's fastest candidate built again beside it, "
                            "their blocks in turn, and record it against that time (the search's time in the "
                            "record's extra, anchor_search_ms): the anchor's compile leaves the GPU idle and cooler, "
                            "and a GPU at its power cap clocks lower as it warms (default: on)")
    group.add_argument("--gpt-iters", type=int, default=None, help="iterations per timed block (default 5)")
    group.add_argument("--gpt-recompute", action="store_true",
                       help="also the recompute table: peerline --recompute off / N (half a stage's layers) / full "
                            "on the compute configuration (quick with --quick)")
    group.add_argument("--gpt-single", action=argparse.BooleanOptionalAction, default=False,
                       help="also the one-GPU part: per configuration, on rank 0's GPU in a fresh process, the whole "
                            "plain torch GPT eager (bf16 parameters, fused AdamW) against peerline --stages 1 "
                            "--no-graph --precision bf16 (row '<configuration> one-GPU eager bf16', tokens/s)")


def selected_shapes(args: argparse.Namespace, quick: bool) -> list[GPTShape]:
    """The configurations asked for, the compute one resized by the --gpt-* size flags."""
    keys = getattr(args, "gpt_configs", None) or (["quick"] if quick else ["compute", "launch"])
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise ValueError(f"gpt: unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    return [shape_named(args, k) for k in keys]


def shape_named(args: argparse.Namespace, key: str) -> GPTShape:
    """Configuration `key`; the compute one resized by the --gpt-* size flags (for every suite that runs it)."""
    if key != "compute":
        return CONFIGS[key]
    sizes = {name: getattr(args, flag) for flag, name in SIZE_FLAGS.items() if getattr(args, flag, None)}
    return replace(CONFIGS[key], **sizes)


def _variants(args: argparse.Namespace, ctx: BenchContext) -> list[str]:
    variants = getattr(args, "gpt_variants", None) or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"gpt: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    variants = sorted(set(variants), key=VARIANTS.index)  # the anchor first: each variant is recorded against it
    if ctx.device.type != "cuda" and "graph" in variants:
        variants.remove("graph")
        ctx.note("gpt: no CUDA: the graph variant is skipped")
    return variants


def anchor_blocks(args: argparse.Namespace, ctx: BenchContext) -> list[str]:
    """The plain anchor's blocks to try: --gpt-anchor-compile, by default both on a GPU and eager on the CPU."""
    choice = getattr(args, "gpt_anchor_compile", None)
    if choice is None and ctx.device.type != "cuda":
        ctx.note("gpt: the anchor's blocks run eager on the CPU (torch.compile's code generation is slow there); "
                 "--gpt-anchor-compile both|on compiles them")
        choice = "off"
    return COMPILE[choice or "both"]


def _recompute_shape(shapes: list[GPTShape]) -> GPTShape | None:
    """The shape of the recompute table: the compute configuration, else the quick one."""
    for wanted in ("compute-bound", "quick"):
        found = next((s for s in shapes if s.name == wanted), None)
        if found is not None:
            return found
    return None


def run(args: argparse.Namespace, ctx: BenchContext) -> None:
    """Every configuration: the anchor's candidates, peerline eager and graph, the recompute table; then the one-GPU
    rows."""
    shapes = selected_shapes(args, ctx.quick)
    variants = _variants(args, ctx)
    for flag, allowed in (("gpt_kernels", KERNELS), ("gpt_zb_memory", ZB_MEMORY), ("gpt_zb_orders", ZB_ORDERS)):
        unknown = [k for k in getattr(args, flag, None) or [] if k not in allowed]
        if unknown:
            raise ValueError(f"gpt: unknown --{flag.replace('_', '-')} {unknown[0]!r}; choose from "
                             f"{', '.join(allowed)}")
    blocks = anchor_blocks(args, ctx) if "torch" in variants else ["eager"]
    pp = dist.get_world_size()
    ctx.facts.setdefault("gpt_grid", f"pp={pp}")
    if not ctx.quick and ctx.device.type != "cuda":
        ctx.note("gpt: the full configurations on the CPU take long; use --quick for a smoke test")
    recompute = _recompute_shape(shapes) if getattr(args, "gpt_recompute", False) else None
    if getattr(args, "gpt_recompute", False) and recompute is None:
        ctx.note("gpt: --gpt-recompute needs the compute configuration (quick with --quick); no table")
    failures: list[str] = []
    for shape in shapes:
        bench = GPTBench(args, ctx, shape, blocks)
        bench.run_variants(variants, failures)
        if shape is recompute:
            bench.recompute_table(failures)
        free_device(ctx.device)
    if getattr(args, "gpt_single", False):
        for shape in shapes:
            one_gpu(args, ctx, shape, failures)
    if failures:
        raise RuntimeError(f"{len(failures)} gpt measurement(s) failed: " + " | ".join(failures))
