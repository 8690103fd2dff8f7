"""The fused LayerNorm (kernels/layer_norm.py) against torch's layer norm on one GPU: device time per call of the
forward and of the backward (dx, dweight, dbias), each captured 20 times into a CUDA graph and replayed, the sides
taken in turn so drift falls on all of them; medians over --reps replays. bf16 input, output and parameters.

    python tools/gpu_probes/layer_norm_probe.py                        # the MLP's, the GPTs' and a small shape
    python tools/gpu_probes/layer_norm_probe.py --shapes 4096x2048 --extra old=/tmp/old/layer_norm.py

--extra NAME=PATH times another copy of kernels/layer_norm.py (for example the committed one, beside an edit) as a
third side. Each side's results are checked against torch's (relative error of y, dx, dweight, dbias).

--residual times the backward of a pre-norm block's LayerNorm with its residual: dx plus the residual's gradient,
and that gradient's column sums (the bias gradient of the Linear before the residual add). Sides: torch (its layer
norm backward, the add, the sum), "fused" (the residual kernel: one pass) and "fused+adds" (the LayerNorm kernel,
then torch's add and sum: the blocks' path before the residual kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections.abc import Callable
from types import ModuleType

import torch

from peerline.kernels import layer_norm as ln

CALLS = 20  # calls per captured graph
EPS = 1e-5


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"layer_norm_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_side() -> tuple[Callable, Callable]:
    def forward(x, w, b):
        y, mean, rstd = torch.native_layer_norm(x, [x.shape[1]], w, b, EPS)
        return y, mean.view(-1), rstd.view(-1)

    def backward(dy, x, w, b, mean, rstd):
        return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[1]], mean.view(-1, 1), rstd.view(-1, 1),
                                                         w, b, [True, True, True])
    return forward, backward


def _module_side(module: ModuleType) -> tuple[Callable, Callable]:
    return (lambda x, w, b: module.layer_norm_forward(x, w, b, EPS)), (
        lambda *args: tuple(module.layer_norm_backward(*args)[:3]))  # an older copy returns three tensors


def _with_adds(backward: Callable) -> Callable:
    """A plain backward followed by torch's add of the residual gradient and its column sums."""
    def run(dy, x, w, b, mean, rstd, dres):
        dx, dw, db = backward(dy, x, w, b, mean, rstd)[:3]
        return dx + dres, dw, db, dres.sum(0, dtype=b.dtype)
    return run


def _residual_sides() -> dict[str, tuple[Callable, Callable]]:
    torch_fwd, torch_bwd = _torch_side()
    fused_fwd, fused_bwd = _module_side(ln)
    fused = (fused_fwd, lambda dy, x, w, b, mean, rstd, dres: ln.layer_norm_backward(
        dy, x, w, b, mean, rstd, residual=dres, residual_sum=True))
    return {"torch": (torch_fwd, _with_adds(torch_bwd)), "fused": fused,
            "fused+adds": (fused_fwd, _with_adds(fused_bwd))}


def _graph(fn: Callable) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return graph


def _time_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / CALLS


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def probe_shape(rows: int, width: int, sides: dict[str, tuple[Callable, Callable]], reps: int,
                residual: bool = False) -> None:
    x = (torch.randn(rows, width, device="cuda") * 2 + 0.5).to(torch.bfloat16)
    w = (torch.randn(width, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    b = (torch.randn(width, device="cuda") * 0.1).to(torch.bfloat16)
    dy = torch.randn(rows, width, device="cuda").to(torch.bfloat16)
    extra = (torch.randn(rows, width, device="cuda").to(torch.bfloat16),) if residual else ()
    graphs, results = {}, {}
    for name, (fwd, bwd) in sides.items():
        y, mean, rstd = fwd(x, w, b)
        results[name] = (y, *bwd(dy, x, w, b, mean, rstd, *extra))
        graphs[name] = (_graph(lambda fwd=fwd: fwd(x, w, b)),
                        _graph(lambda bwd=bwd, mean=mean, rstd=rstd: bwd(dy, x, w, b, mean, rstd, *extra)))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in sides}
    for _ in range(3):  # warm-up replays
        for f, g in graphs.values():
            _time_us(f), _time_us(g)
    for _ in range(reps):
        for name, (f, g) in graphs.items():
            times[name][0].append(_time_us(f))
            times[name][1].append(_time_us(g))
    mib = rows * width * 2 / 2**20
    base = sum(statistics.median(t) for t in times["torch"])
    for name, (f, g) in times.items():
        fwd_us, bwd_us = statistics.median(f), statistics.median(g)
        errors = ", ".join(f"{_rel(a, c):.1e}" for a, c in zip(results[name], results["torch"], strict=True))
        if residual:  # the backward alone: the forward is the LayerNorm's either way
            base_bwd = statistics.median(times["torch"][1])
            print(f"{rows}x{width} ({mib:.0f} MiB) {name:>10}: backward with residual {bwd_us:8.2f} us "
                  f"({4 * mib / bwd_us * 1.048576:.2f} TB/s), torch / this {base_bwd / bwd_us:.3f}; rel. error to "
                  f"torch y, dx, dw, db, residual sums: {errors}", flush=True)
            continue
        print(f"{rows}x{width} ({mib:.0f} MiB) {name:>8}: forward {fwd_us:8.2f} us ({2 * mib / fwd_us * 1.048576:.2f}"
              f" TB/s), backward {bwd_us:8.2f} us ({3 * mib / bwd_us * 1.048576:.2f} TB/s), total "
              f"{fwd_us + bwd_us:8.2f} us, torch / this {base / (fwd_us + bwd_us):.3f}; rel. error to torch y, dx, "
              f"dw, db: {errors}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x2048,2048x2048,2048x3072,4096x4096,512x512,8192x1024",
                        help="rows x width, comma-separated (default: the MLP's compute and mid shapes, the GPTs')")
    parser.add_argument("--extra", action="append", default=[], help="NAME=PATH of another layer_norm.py copy")
    parser.add_argument("--reps", type=int, default=30, help="timed replays per side (default 30)")
    parser.add_argument("--residual", action="store_true",
                        help="time the backward with a residual gradient added and summed (see above)")
    args = parser.parse_args()
    torch.manual_seed(0)
    sides = _residual_sides() if args.residual else {"torch": _torch_side(), "fused": _module_side(ln)}
    for item in args.extra:
        name, _, path = item.partition("=")
        sides[name] = _module_side(_load(path, name))
    print(f"{torch.cuda.get_device_name()}; median of {args.reps} replays of {CALLS} calls; bytes: forward reads x "
          f"and writes y, backward reads x and dy and writes dx", flush=True)
    for shape in args.shapes.split(","):
        rows, width = (int(v) for v in shape.lower().split("x"))
        probe_shape(rows, width, sides, args.reps, args.residual)


if __name__ == "__main__":
    main()
