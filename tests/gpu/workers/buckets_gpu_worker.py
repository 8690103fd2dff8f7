"""One rank of the GPU (NCCL, dp = 2) check of GradBuckets. Launched by test_buckets_gpu.py:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/gpu/workers/buckets_gpu_worker.py [--json OUT]

Prints `PASS <check>` / `FAIL <check>: <why>` per check (rank 0 and any failing rank), exits 1 on any failure;
with --json OUT rank 0 writes {check: {"ok": bool, "detail": why}} over both ranks there.
Checks:
  eager-<sizes>   bucketed grads (hooks release each bucket's all-reduce on the all-reduce stream during the last
                  backward) equal a per-parameter all_reduce(AVG), bitwise; equal a single-process reference of the
                  combined batch within 1e-5; hooks do nothing before arm(); buckets launch during backward;
                  metrics are timed and sane
  eager-...-ctas4 the same on a dp group created with buckets.nccl_options(max_ctas=4) (NCCL's CTA cap), against
                  the per-parameter all-reduce on the default group (bitwise: AVG of two values); -tail: the first
                  layer's buckets on the default group (GradBuckets' tail_group), the others on the capped one
  priority        the all-reduce stream has the device's highest priority
  graph           the whole iteration (zero_grad, M forward/backward, arm/finish) captured in a CUDA graph and
                  replayed on fresh data gives the per-parameter all-reduce's gradients (bitwise)
  graph-timing    metrics() after a replay reads the replay's external timing events
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS on any stream

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from peerline.distributed.grad_sync.buckets import GradBuckets, nccl_options  # noqa: E402
from peerline.distributed.streams import create_rank_streams  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))


class Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(4 * h) * 0.1)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)) + self.bias))


class Net(torch.nn.Module):
    def __init__(self, h: int = 192, blocks: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(40, h)
        self.blocks = torch.nn.ModuleList([Block(h) for _ in range(blocks)])
        self.out = torch.nn.Linear(h, 3)

    def layers(self) -> list[list[torch.nn.Parameter]]:
        return [list(m.parameters()) for m in (self.inp, *self.blocks, self.out)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def batch(it: int, gmb: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * it + gmb)
    return torch.randn(8, 16, 40, generator=g).to(device), torch.randn(8, 16, 3, generator=g).to(device)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def zero_naive(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()


def naive_average(model: torch.nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def check_eager(rank: int, dp: int, dev: torch.device, streams, bucket_mb: float, first_mb: float, M: int,
                group: dist.ProcessGroup | None = None, tag: str = "", tail: dist.ProcessGroup | None = None) -> None:
    name = f"eager-{bucket_mb}MiB-first{first_mb}-M{M}{tag}"
    compute = streams.compute
    torch.manual_seed(11)
    with torch.cuda.stream(compute):
        model = Net().to(dev)
        naive, ref = copy.deepcopy(model), copy.deepcopy(model)
        zero_naive(naive)
        zero_naive(ref)
    gb = GradBuckets(model.layers(), group or dist.group.WORLD, dev, streams.allreduce, bucket_mb, first_mb,
                     tail_group=tail)
    problems = []
    small = bucket_mb < 1
    for it in range(3):
        with torch.cuda.stream(compute):
            data = [batch(it, rank * M + m, dev) for m in range(M)]
            gb.zero_grad()
            zero_naive(naive)
            for m, (x, y) in enumerate(data):
                if m == M - 1:
                    if max_diff(grads(model), grads(naive)) != 0:
                        problems.append(f"it {it}: grads changed before arm()")
                    gb.arm()
                (F.mse_loss(model(x), y) / M).backward()
                (F.mse_loss(naive(x), y) / M).backward()
            gb.finish()
            naive_average(naive)
            got, want = grads(model), grads(naive)
            if max_diff(got, want) != 0:
                problems.append(f"it {it}: differs from per-parameter all-reduce by {max_diff(got, want):.3g}")
            ref.load_state_dict(model.state_dict())
            zero_naive(ref)
            for gm in range(dp * M):
                x, y = batch(it, gm, dev)
                (F.mse_loss(ref(x), y) / (dp * M)).backward()
            for a, b in zip(got, grads(ref), strict=True):
                err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                if err > 1e-5:
                    problems.append(f"it {it}: off the single-process reference by {err:.3g}")
                    break
        m = gb.metrics()
        if not (m["timed"] and m["allreduce_ms"] > 0 and m["exposed_ms"] >= 0 and 0 <= m["hidden_share"] <= 1):
            problems.append(f"it {it}: bad metrics {m}")
        if small and m["launched_in_backward"] < len(gb.buckets) - 1:
            problems.append(f"it {it}: only {m['launched_in_backward']}/{len(gb.buckets)} launched in backward")
        if rank == 0 and it == 2:
            print(f"INFO {name}: {len(gb.buckets)} buckets, allreduce {m['allreduce_ms']:.3f} ms, exposed "
                  f"{m['exposed_ms']:.3f} ms, hidden {m['hidden_share']:.2f}", flush=True)
    gb.close()
    report(name, not problems, "; ".join(problems[:4]))


def check_graph(rank: int, dev: torch.device, streams, M: int = 2) -> None:
    compute = streams.compute
    torch.manual_seed(13)
    with torch.cuda.stream(compute):
        model = Net().to(dev)
        naive = copy.deepcopy(model)
        zero_naive(naive)
        static = [batch(0, rank * M + m, dev) for m in range(M)]
    gb = GradBuckets(model.layers(), dist.group.WORLD, dev, streams.allreduce, 0.05, 0.002)

    def iteration() -> None:
        gb.zero_grad()
        for m, (x, y) in enumerate(static):
            if m == M - 1:
                gb.arm()
            (F.mse_loss(model(x), y) / M).backward()
        gb.finish()

    with torch.cuda.stream(compute):
        for _ in range(3):  # warm-up: NCCL communicator, autograd, allocator
            iteration()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=compute, capture_error_mode="thread_local"):
            iteration()
    except Exception as exc:  # noqa: BLE001 - report the reason, the other checks still run
        report("graph", False, f"capture failed: {type(exc).__name__}: {exc}")
        report("graph-timing", False, "no graph")
        return
    torch.cuda.synchronize()
    problems = []
    timing = None
    for r in range(1, 4):
        with torch.cuda.stream(compute):
            fresh = [batch(100 + r, rank * M + m, dev) for m in range(M)]
            for (sx, sy), (x, y) in zip(static, fresh, strict=True):
                sx.copy_(x)
                sy.copy_(y)
            for p in model.parameters():  # poison: the replay's zero_grad must clear it
                p.grad.fill_(float("nan"))
            graph.replay()
            zero_naive(naive)
            for x, y in fresh:
                (F.mse_loss(naive(x), y) / M).backward()
            naive_average(naive)
            got, want = grads(model), grads(naive)
            d = max_diff(got, want)
            scale = max(w.abs().max().item() for w in want)
        # Replayed kernels are the eager ones, so this is normally bitwise; allow 1e-6 of the largest gradient in
        # case cuBLAS picks another algorithm under capture (a reduction bug is far larger, or NaN from poison).
        if not d <= 1e-6 * scale:
            problems.append(f"replay {r}: differs from per-parameter all-reduce by {d:.3g} (max |grad| {scale:.3g})")
        elif rank == 0 and d != 0:
            print(f"INFO graph replay {r}: not bitwise, max diff {d:.3g} of max |grad| {scale:.3g}", flush=True)
        timing = gb.metrics()
    report("graph", not problems, "; ".join(problems))
    ok = bool(timing and timing.get("timed") and timing["allreduce_ms"] > 0 and timing["exposed_ms"] >= 0)
    report("graph-timing", ok, "" if ok else f"metrics after replay: {timing}")
    if rank == 0 and ok:
        print(f"INFO graph: allreduce {timing['allreduce_ms']:.3f} ms, exposed {timing['exposed_ms']:.3f} ms",
              flush=True)
    gb.close()


def write_json(path: str, per_rank: list[list[tuple[str, bool, str]]]) -> None:
    """One verdict per check: ok only where every rank said so, with the failing ranks' details."""
    merged: dict[str, dict] = {}
    for rank, results in enumerate(per_rank):
        for name, ok, detail in results:
            entry = merged.setdefault(name, {"ok": True, "detail": ""})
            if not ok:
                entry["ok"] = False
                entry["detail"] += f"rank {rank}: {detail}\n"
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)


def main() -> int:
    dist.init_process_group("nccl")
    rank, dp = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    streams = create_rank_streams(dev)
    report("priority", streams.allreduce.priority == torch.cuda.Stream.priority_range()[1],
           f"allreduce stream priority {streams.allreduce.priority}, range {torch.cuda.Stream.priority_range()}")
    for bucket_mb, first_mb, M in [(0.05, 0.002, 2), (0.3, 0.01, 1), (25, 1, 3)]:
        try:
            check_eager(rank, dp, dev, streams, bucket_mb, first_mb, M)
        except Exception as exc:  # noqa: BLE001
            report(f"eager-{bucket_mb}", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        capped = dist.new_group(list(range(dp)), pg_options=nccl_options(max_ctas=4))
        if rank == 0:
            try:  # what torch handed to NCCL (informational: the binding may differ between versions)
                cfg = capped._get_backend(dev).options.config
                print(f"INFO capped group: NCCL config max_ctas={cfg.max_ctas} min_ctas={cfg.min_ctas}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"INFO capped group options unreadable: {type(exc).__name__}: {exc}", flush=True)
        check_eager(rank, dp, dev, streams, 0.3, 0.01, 2, group=capped, tag="-ctas4")
        # The capped group for the buckets overlapped with backward, the default one for the first layer's.
        check_eager(rank, dp, dev, streams, 0.05, 0.002, 1, group=capped, tag="-ctas4-tail", tail=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001
        report("eager-ctas4", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        check_graph(rank, dev, streams)
    except Exception as exc:  # noqa: BLE001
        report("graph", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    torch.cuda.synchronize()
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, RESULTS)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and "--json" in sys.argv:
        write_json(sys.argv[sys.argv.index("--json") + 1], gathered)
    failed = [r for r in RESULTS if not r[1]]
    for name, ok, detail in RESULTS:
        if rank == 0 or not ok:
            print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f" (rank {rank}): {detail}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
