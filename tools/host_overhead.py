"""Host (Python) overhead of peerline's eager iteration on the CPU, against a plain torch loop of the same model.

    python tools/host_overhead.py                        # GPT and MLP: peerline vs plain torch, median ms/iter
    python tools/host_overhead.py --models mlp --iters 60
    python tools/host_overhead.py --profile              # cProfile of peerline's iterations: top 25 functions
    python tools/host_overhead.py --profile --models gpt --top 40

The models are tiny (hidden 32, seq 8, micro-batch 1, 16 layers, M=8 by default) and run in fp32 on the CPU
with torch on one thread, so compute is negligible and the time per iteration is mostly host work.

peerline runs in this one process as the main job runs it (launch/pipeline.py's Runtime with the preemption
and failsafe hooks), two stages as streams of one device (`--stages 2`, 1F1B, `--no-graph`, gloo-free: no
process group), the loss read back every iteration (--log-every 1, the default). The GPT reads token ids from a
deterministic feed defined here (`token_feed`); the MLP is the default residual-MLP model on seeded floats.

The floor is the same architecture as a plain torch loop: forward and backward of the same M microbatches,
then one AdamW step (torch's default implementation) and zero_grad. For the GPT it is
bench/suites/plain_gpt.py's PlainGPT with cross-entropy; for the MLP an nn.Sequential of pre-norm residual MLP
blocks (x + fc2(gelu(fc1(norm(x)) + b1))) with an MSE loss. The floor's loss is read back every iteration too.

Each measurement runs --warmup iterations, then --iters timed ones; the median of the per-iteration times is
reported (ms/iter), with the ratio peerline / torch (1.00 = no overhead over the floor).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout: `import peerline` finds the checkout (peerline/__init__.py)
    sys.path.insert(1, REPO)

import torch  # noqa: E402  (after the path set-up above)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODELS = ("gpt", "mlp")
VOCAB = 64


def token_feed(seq: int, micro_batch_size: int) -> SimpleNamespace:
    """A user token feed (`--data host_overhead:token_feed`): token t of row r of global microbatch g at
    iteration i is (i * 7 + g * 5 + r * 3 + t) % VOCAB; labels are the next tokens."""

    def fill(inputs: torch.Tensor, labels: torch.Tensor, iteration: int, global_mb: int) -> None:
        rows = _tokens(seq, micro_batch_size, iteration, global_mb)
        inputs.copy_(rows[:, :-1])
        labels.copy_(rows[:, 1:])

    return SimpleNamespace(fill=fill, vocab=VOCAB)


def _tokens(seq: int, micro_batch_size: int, iteration: int, global_mb: int) -> torch.Tensor:
    base = torch.arange(seq + 1) + iteration * 7 + global_mb * 5
    return torch.stack([(base + 3 * r) % VOCAB for r in range(micro_batch_size)])


# -- peerline ---------------------------------------------------------------------------------------------------

def peerline_runtime(model: str, args: argparse.Namespace) -> Any:
    """The main job's Runtime (preemption and failsafe hooks) of `model`, two stages in this process, eager."""
    from peerline.distributed.config import RunConfig
    from peerline.distributed.resilience.failsafe import Failsafe
    from peerline.distributed.resilience.preemption import Preemption
    from peerline.distributed.runtime import Runtime

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):  # one process, whatever launched this
        os.environ.pop(name, None)
    extra: dict[str, Any] = {}
    if model == "gpt":
        extra = dict(model="gpt", heads=args.heads, data="host_overhead:token_feed", vocab=VOCAB)
    cfg = RunConfig(**extra, layers=args.layers, hidden=args.hidden, seq=args.seq,
                    micro_batch_size=args.micro_batch_size, microbatches=args.microbatches, stages=2,
                    schedule="1f1b", graph=False, dtype="fp32", device="cpu", iters=10**9)
    return Runtime.create(cfg, hooks=[Preemption.attach, Failsafe.attach])


def time_both(model: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds of each timed iteration of peerline's training loop (each iteration's loss is read) and of
    the plain torch loop, interleaved (one of each in turn, so both see the same load on a shared machine): wall
    time ("peerline", "torch") and this thread's CPU time ("peerline cpu", "torch cpu"; torch runs its ops on
    the calling thread with --threads 1, so other processes on the machine do not count)."""
    step = plain_step(model, args)
    rt = peerline_runtime(model, args)
    times: dict[str, list[float]] = {"peerline": [], "torch": [], "peerline cpu": [], "torch cpu": []}
    # and "calls": Python calls per iteration of each, [peerline, torch] (counted after the timed iterations)
    mark = [0.0, 0.0]

    def between(_stats: Any) -> None:
        """After each peerline iteration: its times, then one timed plain step, then the next one's start."""
        wall, cpu = time.perf_counter(), time.thread_time()
        times["peerline"].append((wall - mark[0]) * 1e3)
        times["peerline cpu"].append((cpu - mark[1]) * 1e3)
        step(len(times["torch"]))
        times["torch"].append((time.perf_counter() - wall) * 1e3)
        times["torch cpu"].append((time.thread_time() - cpu) * 1e3)
        mark[:] = time.perf_counter(), time.thread_time()

    try:
        rt.train(rt.iteration + args.warmup, on_iteration=between)
        for v in times.values():
            v.clear()
        mark[:] = time.perf_counter(), time.thread_time()
        rt.train(rt.iteration + args.iters, on_iteration=between)
        times["calls"] = [python_calls(lambda: rt.train(rt.iteration + 2)) / 2,
                          python_calls(lambda: [step(i) for i in range(2)]) / 2]
    finally:
        rt.close()
    return times


def python_calls(fn: Callable[[], Any]) -> float:
    """Python (and builtin) function calls made by `fn`, counted by cProfile: host work as a count that does
    not depend on the machine's load."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return float(sum(v[1] for v in pstats.Stats(prof).stats.values()))  # type: ignore[attr-defined]


def profile_peerline(model: str, args: argparse.Namespace) -> str:
    """cProfile of --iters iterations of peerline's training loop after warm-up: the top --top functions by
    cumulative and by own time."""
    rt = peerline_runtime(model, args)
    try:
        rt.train(rt.iteration + args.warmup)
        prof = cProfile.Profile()
        prof.enable()
        rt.train(rt.iteration + args.iters)
        prof.disable()
    finally:
        rt.close()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    out.write(f"== {model}: {args.iters} iterations, {calls / args.iters:.0f} Python calls per iteration ==\n")
    for key in ("cumulative", "tottime"):
        stats.sort_stats(key).print_stats(args.top)
    out.write(own_time_by_place(stats.stats, args.iters))  # type: ignore[attr-defined]
    return out.getvalue()


def own_time_by_place(stats: dict, iters: int) -> str:
    """Own (exclusive) time and calls per iteration, summed by where the function lives: a folder of this
    checkout (distributed/pipeline, kernels, models, ...), torch's Python, other Python, or builtins (torch's
    ops and C calls). Profiled time: the profiler's cost per call inflates Python next to the ops."""
    places: dict[str, list[float]] = {}
    for (path, _line, _name), (_cc, calls, own, _cum, _callers) in stats.items():
        if path == "~":
            place = "builtins (torch ops, C calls)"
        elif path.startswith(REPO + os.sep):
            parts = os.path.relpath(path, REPO).split(os.sep)
            place = "/".join(parts[:2]) if parts[0] == "distributed" and len(parts) > 2 else parts[0]
        elif f"{os.sep}torch{os.sep}" in path:
            place = "torch (Python)"
        else:
            place = "other Python"
        acc = places.setdefault(place, [0.0, 0.0])
        acc[0] += own
        acc[1] += calls
    total = sum(v[0] for v in places.values()) or 1.0
    lines = [f"own time per iteration by place ({iters} iterations, profiled):",
             f"  {'place':32} {'ms/iter':>8} {'share':>6} {'calls/iter':>10}"]
    for place, (own, calls) in sorted(places.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {place:32} {own / iters * 1e3:8.2f} {own / total:6.1%} {calls / iters:10.0f}")
    return "\n".join(lines) + "\n"


# -- plain torch --------------------------------------------------------------------------------------------------

class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)) + b1)): the residual-MLP block in plain torch (exact GELU)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc1_bias = nn.Parameter(torch.zeros(4 * hidden))
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)) + self.fc1_bias))


def plain_step(model: str, args: argparse.Namespace) -> Callable[[int], float]:
    """One training step of the plain torch model: forward + backward of M microbatches, AdamW, zero_grad;
    returns the iteration's loss (read back, as peerline's loop reads it)."""
    torch.manual_seed(0)
    b, t, h, m = args.micro_batch_size, args.seq, args.hidden, args.microbatches
    if model == "gpt":
        sys.path.insert(1, os.path.join(REPO, "bench", "suites"))
        from plain_gpt import PlainGPT

        net: nn.Module = PlainGPT(vocab=VOCAB, hidden=h, heads=args.heads, layers=args.layers, seq=t)
        batches = [(rows[:, :-1], rows[:, 1:]) for rows in (_tokens(t, b, 0, mb) for mb in range(m))]

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())
    else:
        net = nn.Sequential(*[MLPBlock(h) for _ in range(args.layers)])
        batches = [(torch.randn(b, t, h), torch.randn(b, t, h)) for _ in range(m)]

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(net(x).float(), y)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(_iteration: int) -> float:
        total = torch.zeros(())
        for x, y in batches:
            loss = loss_of(x, y) / m
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return float(total)

    return step


# -- main ----------------------------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    p.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp (default: %(default)s)")
    p.add_argument("--layers", type=int, default=16, help="blocks (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=32, help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=2, help="attention heads of the GPT (default: %(default)s)")
    p.add_argument("--seq", type=int, default=8, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch (default: %(default)s)")
    p.add_argument("--microbatches", "-m", type=int, default=8,
                   help="microbatches per iteration (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default: %(default)s)")
    p.add_argument("--iters", type=int, default=40, help="timed (or profiled) iterations (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of peerline's iterations "
                   "instead of timing")
    p.add_argument("--top", type=int, default=25,
                   help="functions listed per sort with --profile (default: %(default)s)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown model {bad[0]!r}; choose from {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    sys.modules.setdefault("host_overhead", sys.modules[__name__])  # the feed's spec resolves to this module
    shape = (f"layers {args.layers}, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch_size}, "
             f"M={args.microbatches}, fp32, CPU, {args.threads} thread(s), median of {args.iters} after "
             f"{args.warmup} warm-up")
    if args.profile:
        for model in args.models:
            print(profile_peerline(model, args))
        return 0
    print(shape)
    print(f"{'model':6} {'measure':17} {'peerline':>10} {'torch':>10} {'ratio':>6}")
    for model in args.models:
        times = time_both(model, args)
        for what, suffix in (("ms/iter (wall)", ""), ("ms/iter (cpu)", " cpu")):
            mine = statistics.median(times["peerline" + suffix])
            floor = statistics.median(times["torch" + suffix])
            print(f"{model:6} {what:17} {mine:10.2f} {floor:10.2f} {mine / floor:6.2f}", flush=True)
        mine, floor = times["calls"]
        print(f"{model:6} {'Python calls/iter':17} {mine:10.0f} {floor:10.0f} {mine / floor:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
