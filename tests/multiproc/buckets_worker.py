"""One rank of the bucketed all-reduce check on the CPU (gloo). Launched by test_buckets_multiproc.py under
`torchrun --nproc_per_node=2` or `mpirun -n 2`; exits non-zero with one line per failure.

For several (odd) bucket sizes and M microbatches of gradient accumulation it checks, every iteration:
  - before arm() the hooks do nothing: after microbatches 0..M-2 the bucketed grads equal the local ones;
  - after finish() the bucketed grads equal a naive per-parameter all_reduce(SUM) / dp, bitwise;
  - they equal a single-process reference over the combined batch (all ranks' microbatches) to 1e-5;
  - `.grad` stays a view into the flat buffer; an unused parameter is reduced (zeros) without hanging;
  - after an SGD step the bucketed and naive models hold identical parameters;
  - with a tail_group, the buckets of the first layer are all-reduced there, with the same results.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from peerline.distributed.grad_sync.buckets import GradBuckets, MiB

FAILURES: list[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        FAILURES.append(what)


def init_process_group() -> tuple[int, int]:
    env = os.environ
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:  # mpirun: torch's env:// wants RANK / WORLD_SIZE
        env["RANK"], env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


class Block(torch.nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear -> residual, with odd sizes."""

    def __init__(self, h: int, inner: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, inner, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(inner) * 0.1)
        self.down = torch.nn.Linear(inner, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)) + self.bias))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(13, 96)
        self.blocks = torch.nn.ModuleList([Block(96, 333), Block(96, 57)])  # 96 x 333 fp32 = 125 KiB: > a bucket
        self.unused = torch.nn.Linear(7, 3)  # never in the graph: reduced as zeros by finish()
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.out = torch.nn.Linear(96, 3)  # its 3-float bias rides with its weight in the first bucket

    def layers(self) -> list[list[torch.nn.Parameter]]:
        # `unused` first, so last in ready order: a bucket never completes in backward and blocks the (in-order)
        # launch of every bucket after it, so an unused parameter belongs at the end of backward.
        mods = [self.unused, self.inp, *self.blocks, self.out]
        return [list(m.parameters()) for m in mods] + [[self.frozen]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def batch(iteration: int, global_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + global_mb)
    return torch.randn(6, 13, generator=g), torch.randn(6, 3, generator=g)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def run_case(rank: int, dp: int, bucket_mb: float, first_mb: float, M: int, iters: int = 3,
             tail: dist.ProcessGroup | None = None) -> None:
    tag = f"[bucket_mb={bucket_mb} first={first_mb} M={M}{' tail group' if tail is not None else ''}]"
    torch.manual_seed(7)
    model = Net()
    naive, ref = copy.deepcopy(model), copy.deepcopy(model)
    for p in [*naive.parameters(), *ref.parameters()]:
        if p.requires_grad:  # the unused parameter would otherwise keep grad None
            p.grad = torch.zeros_like(p)
    gb = GradBuckets(model.layers(), dist.group.WORLD, torch.device("cpu"), None, bucket_mb, first_mb, tail_group=tail)
    if tail is not None:
        # layers()[0] is `unused` (the first layer): only buckets holding one of its parameters use the tail group.
        want = [any(p is q for p in b.params for q in model.unused.parameters()) for b in gb.buckets]
        check([g is tail for g in gb.bucket_groups] == want and any(want),
              f"{tag} tail buckets {[g is tail for g in gb.bucket_groups]}, want {want}")
    small = bucket_mb < 0.1  # the odd layouts this model is sized for
    if small:
        check(len(gb.buckets) >= 4, f"{tag} expected several buckets, got {len(gb.buckets)}")
        caps = [first_mb] + [bucket_mb] * (len(gb.buckets) - 1)
        check(all(b.nbytes >= c * MiB for b, c in zip(gb.buckets[:-1], caps, strict=False)),
              f"{tag} a bucket other than the last is below its cap: {[b.nbytes for b in gb.buckets]}")
        check(gb.buckets[0].params[0] is model.out.bias and len(gb.buckets[0].params) > 1,
              f"{tag} the output bias should ride in the first bucket with the output weight")
        big = [b for b in gb.buckets if any(p is model.blocks[0].up.weight for p in b.params)]
        check(len(big) == 1 and big[0].params[-1] is model.blocks[0].up.weight,
              f"{tag} a parameter larger than a bucket must close the bucket it joins")
        check(any(p is model.unused.weight for p in gb.buckets[-1].params), f"{tag} unused weight not in the last")
    opt, opt_naive = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(naive.parameters(), lr=0.05)
    flat = gb.flat[torch.float32]

    for it in range(iters):
        gb.zero_grad()
        naive.zero_grad(set_to_none=False)
        for m in range(M):
            x, y = batch(it, rank * M + m)
            if m == M - 1:
                check(all(torch.equal(a, b) for a, b in zip(grads(model), grads(naive), strict=True)),
                      f"{tag} it {it}: grads changed before arm() (a hook reduced too early)")
                gb.arm()
            (F.mse_loss(model(x), y) / M).backward()
            (F.mse_loss(naive(x), y) / M).backward()
        gb.finish()
        for p in naive.parameters():
            if p.requires_grad:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(dp)
        got, want = grads(model), grads(naive)
        check(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
              f"{tag} it {it}: bucketed grads differ from per-parameter all-reduce: max "
              f"{max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)):.3g}")
        for p in model.parameters():
            if p.requires_grad:
                lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
                check(lo <= p.grad.data_ptr() < hi, f"{tag} it {it}: .grad is no longer a view into the bucket")
        check(bool((model.unused.weight.grad == 0).all()), f"{tag} it {it}: unused parameter got a gradient")
        # Single-process reference of the combined batch (what one rank with dp * M microbatches computes).
        ref.load_state_dict(model.state_dict())
        ref.zero_grad(set_to_none=False)
        for gm in range(dp * M):
            x, y = batch(it, gm)
            (F.mse_loss(ref(x), y) / (dp * M)).backward()
        for a, b in zip(got, grads(ref), strict=True):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
            check(err <= 1e-5, f"{tag} it {it}: bucketed grads off the single-process reference by {err:.3g}")
        metrics = gb.metrics()
        check(metrics["timed"] and metrics["exposed_ms"] >= 0, f"{tag} it {it}: bad metrics {metrics}")
        check(metrics["launched_in_backward"] >= (len(gb.buckets) - 1 if small else 0),
              f"{tag} it {it}: only {metrics['launched_in_backward']} buckets launched during backward")
        opt.step()
        opt_naive.step()
        check(all(torch.equal(a, b) for a, b in zip(model.parameters(), naive.parameters(), strict=True)),
              f"{tag} it {it}: parameters diverged after the optimizer step")

    # Misuse: a second backward after arm() must fail loudly rather than silently lose a gradient.
    gb.zero_grad()
    gb.arm()
    x, y = batch(99, rank)
    F.mse_loss(model(x), y).backward()
    try:
        F.mse_loss(model(x), y).backward()
        check(False, f"{tag} a second backward after arm() did not raise")
    except RuntimeError as exc:
        check("twice" in str(exc), f"{tag} unexpected error for a second backward: {exc}")
    gb.finish()  # every bucket launched already on both ranks: drains without hanging
    gb.close()


def main() -> int:
    rank, dp = init_process_group()
    cases = [(0.05, 0.001, 3), (0.0123, 0.0007, 1), (0.2, 0.01, 2), (25, 1, 2)]
    tail = dist.new_group(list(range(dp)))  # a second gloo group: the tail buckets' all-reduces go there
    cases = [*cases, (0.05, 0.001, 2, tail)]
    for bucket_mb, first_mb, M, *rest in cases:
        try:
            run_case(rank, dp, bucket_mb, first_mb, M, tail=rest[0] if rest else None)
        except Exception as exc:  # noqa: BLE001 - report and keep the ranks in step
            FAILURES.append(f"[bucket_mb={bucket_mb}] raised {type(exc).__name__}: {exc}")
            break
    dist.barrier()
    dist.destroy_process_group()
    for f in FAILURES:
        print(f"rank {rank} FAIL {f}", file=sys.stderr)
    if not FAILURES:
        print(f"rank {rank} OK {len(cases)} cases")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
