"""Where one pipeline stage of the plain torch GPT (bench/suites/plain_gpt.py, the gpt suite's anchor) and the same
stage of peerline's GPT (models/gpt.py, built as --model gpt --precision bf16 builds it) spend device time, kernel
by kernel: forward + backward of M microbatches through the same blocks with bf16 parameters, under torch.profiler.
Per side: device time per iteration by class (top_kernels.kernel_class) and the top kernels, on a GPU also the host
ops by self CPU time (where an eager side's wall time above its device time goes); then the classes side by side,
and the attention backend each side runs. Both sides stay resident and take their iterations in turn, the first
swapped every round, so a GPU that heats up over the run weighs on both alike. One GPU; on the CPU the rows are aten
ops by self CPU time (what the unit test runs). INFO lines only.

    PYTHONPATH=$PWD python3 tools/gpu_probes/stage_kernels_probe.py [--blocks 12 --hidden 2048 --microbatches 8 ...]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from top_kernels import kernel_class
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from peerline.bench.suites import plain_gpt
from peerline.distributed.config import RunConfig
from peerline.distributed.precision import apply_precision
from peerline.kernels import ops
from peerline.kernels.rope import attention_backend, fused_supported, resolve_backend
from peerline.models.gpt import build_gpt_layers

SIDES = ("torch", "peerline")
CLASSES = ("gemm", "attention", "other", "copies")
CPU_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
VOCAB = 4096  # no embedding or head in a middle stage: the vocabulary only sizes layers that are not built


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults: the gpt bench's compute shape of one stage at pp=2.")
    p.add_argument("--blocks", type=int, default=12, help="blocks in the stage (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per microbatch (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=8,
                   help="forward + backward passes per iteration (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3,
                   help="profiled iterations, after as many timed unprofiled (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="iterations before profiling (default: %(default)s)")
    p.add_argument("--top", type=int, default=15, help="kernels listed per side (default: %(default)s)")
    p.add_argument("--kernels", default="auto", choices=("auto", "peerline", "torch"),
                   help="peerline's --kernels (default: %(default)s). The probe runs eagerly, where auto sends a "
                        "LayerNorm below 64 MiB to torch's op; peerline takes the kernels a captured iteration of "
                        "these sizes runs")
    p.add_argument("--torch-compile", action="store_true",
                   help="the torch side's blocks each torch.compile'd (plain_gpt.compile_blocks, as the gpt suite's "
                        "compiled anchor runs them)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"),
                   help="default: %(default)s")
    return p.parse_args(argv)


def build_torch(a: argparse.Namespace, device: torch.device) -> tuple[nn.Module, list[nn.Module]]:
    """plain_gpt's blocks 1..blocks of a 2 x blocks model, cast as the bench's bf16-params recipe casts them (the
    RoPE table stays complex64). Returns the model and its blocks."""
    model = plain_gpt.PlainGPT(vocab=VOCAB, hidden=a.hidden, heads=a.heads, layers=2 * a.blocks, seq=a.seq,
                               start=1, stop=a.blocks + 1).to(device, torch.bfloat16)
    if a.torch_compile:
        plain_gpt.compile_blocks(model)
    return model, list(model.layers.values())


def peerline_config(a: argparse.Namespace) -> RunConfig:
    return RunConfig(model="gpt", precision="bf16", hidden=a.hidden, heads=a.heads, layers=2 * a.blocks, seq=a.seq,
                     micro_batch_size=a.micro_batch, microbatches=a.microbatches, kernels=a.kernels)


def build_peerline(a: argparse.Namespace, device: torch.device) -> tuple[nn.Module, list[nn.Module]]:
    """peerline's blocks 1..blocks of a 2 x blocks GPT as the engine builds them (distributed/assemble.py): kernels
    resolved for the device, moved there, parameters cast by the bf16 recipe (RoPE tables stay fp32)."""
    cfg = peerline_config(a)
    kernels = ops.resolve_impl(cfg.kernels, device)
    model = nn.Sequential(*build_gpt_layers(vocab=VOCAB, hidden=a.hidden, heads=a.heads, layers=cfg.layers,
                                            seq=a.seq, seed=cfg.seed, kernels=kernels, start=1,
                                            stop=a.blocks + 1)).to(device)
    apply_precision(cfg, [model], None, device)
    return model, list(model)


BUILDERS: dict[str, Callable[[argparse.Namespace, torch.device], tuple[nn.Module, list[nn.Module]]]] = {
    "torch": build_torch, "peerline": build_peerline}


def block_params(blocks: list[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in b.parameters()) for b in blocks]


def stage_iteration(model: nn.Module, x: torch.Tensor, microbatches: int) -> None:
    """One stage's work of an iteration: fresh gradients, forward + backward of every microbatch."""
    model.zero_grad(set_to_none=True)
    for _ in range(microbatches):
        inp = x.detach().requires_grad_(True)
        model(inp).float().square().mean().backward()


def held_by_forward(model: nn.Module, x: torch.Tensor, blocks: list[nn.Module]) -> float:
    """Device bytes one microbatch's forward leaves allocated for its backward, per block (the output excluded)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(x.detach().requires_grad_(True))
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del out
    return held / len(blocks)


def op_class(name: str) -> str:
    """A GPU kernel's class (top_kernels.kernel_class; copies and memsets: copies); on the CPU, aten's matmuls are
    gemm."""
    if name.startswith(("Memcpy", "Memset")):
        return "copies"
    return "gemm" if name in CPU_GEMMS else kernel_class(name)


def _host_ops(prof: profile, aten_only: bool) -> Iterator[Any]:
    """The profile's host ops (not async events, user annotations or Python frames); aten's ops alone with
    `aten_only`."""
    for e in prof.events():
        if e.device_type == DeviceType.CPU and not e.is_async and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith("[") and (not aten_only or e.name.startswith("aten::")):
            yield e


def _tally(events: Iterable[Any], time_us: Callable[[Any], float]) -> tuple[collections.Counter, collections.Counter]:
    us: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        us[e.name] += time_us(e)
        calls[e.name] += 1
    return us, calls


def device_rows(prof: profile, on_gpu: bool) -> tuple[collections.Counter, collections.Counter]:
    """(us by name, calls by name): GPU kernels, copies and memsets by duration; on the CPU, aten's ops by self
    time (the stage's work: the autograd engine's own events would carry the host's scheduling stalls)."""
    if on_gpu:
        return _tally((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                      lambda e: e.time_range.elapsed_us())
    return _tally(_host_ops(prof, aten_only=True), lambda e: e.self_cpu_time_total)


def host_rows(prof: profile) -> tuple[collections.Counter, collections.Counter]:
    """(us by name, calls by name) of every host op by self CPU time, the autograd engine's included: where an
    eager run's host time goes."""
    return _tally(_host_ops(prof, aten_only=False), lambda e: e.self_cpu_time_total)


@dataclass
class Side:
    """One side of the probe, resident for the whole run, with what its iterations gathered."""

    name: str
    model: nn.Module
    blocks: list[nn.Module]
    wall_s: float = 0.0
    us: collections.Counter = field(default_factory=collections.Counter)
    calls: collections.Counter = field(default_factory=collections.Counter)
    host_us: collections.Counter = field(default_factory=collections.Counter)
    host_calls: collections.Counter = field(default_factory=collections.Counter)


def run_sides(a: argparse.Namespace, device: torch.device) -> list[Side]:
    """Builds both sides and keeps them resident; warms each, then takes their timed and their profiled iterations
    in turn, the side that goes first swapped every round: a GPU that heats up over the run (and clocks lower under
    its power cap) then weighs on both sides alike."""
    sides = [Side(name, *BUILDERS[name](a, device)) for name in SIDES]
    x = torch.randn(a.micro_batch, a.seq, a.hidden, device=device, dtype=torch.bfloat16)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for side in sides:
        for _ in range(a.warmup):
            stage_iteration(side.model, x, a.microbatches)
        sync()
        if on_gpu:
            print(f"INFO {side.name}: one microbatch's forward holds "
                  f"{held_by_forward(side.model, x, side.blocks) / 2**20:.1f} MiB per block (what backward keeps)",
                  flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for i in range(a.iters):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            start = time.perf_counter()
            stage_iteration(side.model, x, a.microbatches)
            sync()
            side.wall_s += time.perf_counter() - start
    for i in range(a.iters):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            with profile(activities=activities) as prof:
                stage_iteration(side.model, x, a.microbatches)
                sync()
            us, calls = device_rows(prof, on_gpu)
            side.us.update(us)
            side.calls.update(calls)
            if on_gpu:
                host_us, host_calls = host_rows(prof)
                side.host_us.update(host_us)
                side.host_calls.update(host_calls)
    return sides


def report_side(side: Side, a: argparse.Namespace, on_gpu: bool) -> dict[str, float]:
    """Prints one side's lines; returns its ms per iteration by class."""
    per_it = a.iters * 1000.0  # us -> ms per iteration
    classes: collections.Counter = collections.Counter()
    for kernel, t in side.us.items():
        classes[op_class(kernel)] += t / per_it
    params = block_params(side.blocks)
    print(f"INFO {side.name}: {len(side.blocks)} blocks of {params[0]} parameters; "
          f"{'device' if on_gpu else 'self CPU'} time {sum(classes.values()):.2f} ms per iteration (wall "
          f"{side.wall_s * 1e3 / a.iters:.2f} ms unprofiled): "
          + ", ".join(f"{k} {v:.2f}" for k, v in classes.most_common()), flush=True)
    for kernel, t in side.us.most_common(a.top):
        print(f"INFO {side.name:8s} {t / per_it:8.2f} ms  x{side.calls[kernel] / a.iters:6.0f}  {kernel[:100]}")
    if on_gpu:  # where the host's time goes, for an eager run slower than its device time
        print(f"INFO {side.name} host: self CPU {sum(side.host_us.values()) / per_it:.2f} ms per iteration over "
              f"{sum(side.host_calls.values()) / a.iters:.0f} op calls", flush=True)
        for op, t in side.host_us.most_common(a.top):
            print(f"INFO {side.name:8s} host {t / per_it:8.2f} ms  x{side.host_calls[op] / a.iters:6.0f}  {op[:100]}")
    return dict(classes)


def attention_choices(a: argparse.Namespace, device: torch.device) -> str:
    """The SDPA backend torch picks for the plain model's q, k, v (RoPE'd q and k contiguous [B, T, heads, D], v a
    view of the packed qkv, all transposed to [B, heads, T, D]) and what PEERLINE_ATTENTION resolves to for
    peerline's views of its packed qkv."""
    head_dim = a.hidden // a.heads
    qkv = torch.zeros(a.micro_batch, a.seq, 3 * a.hidden, device=device, dtype=torch.bfloat16)
    qkv5 = qkv.view(a.micro_batch, a.seq, 3, a.heads, head_dim)
    xq, xk, xv = qkv5.unbind(2)
    plain = [t.transpose(1, 2).detach().requires_grad_(True) for t in (xq.contiguous(), xk.contiguous(), xv)]
    picked = SDPBackend(int(torch._fused_sdp_choice(*plain, is_causal=True))).name
    name = attention_backend()
    resolved = resolve_backend(name, *(qkv5[:, :, i].transpose(1, 2) for i in range(3)))
    kernels = ops.resolve_impl(peerline_config(a).kernels, device)
    fused = kernels != "torch" and fused_supported(qkv, a.heads)
    ours = "flash attention's ops" if resolved is None else resolved.name
    path = f"the fused RoPE path runs {ours}" if fused else "the unfused reference path runs torch's SDPA"
    return (f"INFO attention: torch's SDPA picks {picked} for the plain model; peerline (kernels {kernels}, "
            f"PEERLINE_ATTENTION={name}): {path}")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device = torch.device(a.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"INFO {where}, torch {torch.__version__}: {a.blocks} blocks, hidden {a.hidden}, {a.heads} heads, seq "
          f"{a.seq}, micro-batch {a.micro_batch}, {a.microbatches} microbatches; per side {a.warmup} warm-up "
          f"iterations, then {a.iters} timed and {a.iters} profiled, the sides in turn", flush=True)
    by_side = {side.name: report_side(side, a, device.type == "cuda") for side in run_sides(a, device)}
    extra = sorted({k for c in by_side.values() for k in c} - set(CLASSES))
    print(f"INFO {'class':10s} {'torch':>9s} {'peerline':>9s} {'peerline-torch':>15s}  (ms per iteration)")
    for cls in (*CLASSES, *extra, "total"):
        t, p = (sum(by_side[s].values()) if cls == "total" else by_side[s].get(cls, 0.0) for s in SIDES)
        print(f"INFO {cls:10s} {t:9.2f} {p:9.2f} {p - t:+15.2f}")
    print(attention_choices(a, device), flush=True)


if __name__ == "__main__":
    main()
