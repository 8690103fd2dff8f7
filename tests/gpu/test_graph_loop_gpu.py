"""GPU checks of --graph-loop K (distributed/graph_loop.py): K iterations from one host launch of a looped graph
must train exactly as one replay per iteration does. Skipped without CUDA.

Bitwise (losses at every logged iteration, every layer's parameter checksums): the looped body is the captured
iteration itself, on the same data (the ring holds what the feed would have written), so nothing may differ, not
even rounding. Against eager fp32 (TF32 off): 1e-6 relative, as the graph-vs-eager checks elsewhere. The static
input buffers are poisoned with NaN after capture, so a loop that did not copy its data from the ring fails.
Cases: one stage (fp32, torch kernels), two stages as streams of one GPU (fp32), and the defaults (bf16 autocast,
peerline kernels), each with the default seeded data (a device-side ring the host fills); --data counter (the
graph makes its own data from a device counter): its kernel against the torch reference, loop == single replays
bitwise, graph == eager.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from peerline.distributed.config import RunConfig  # noqa: E402
from peerline.distributed.hooks import IterationHooks  # noqa: E402
from peerline.distributed.runtime import Runtime  # noqa: E402

K = 4
ITERS = 18  # warm-up 0-1 eager, capture at 2; 2-3 single replays, 4-15 three loops, 16-17 single replays


class _CountLoops(IterationHooks):
    """Counts the launches that ran more than one iteration (a looped graph's)."""

    def __init__(self) -> None:
        self.looped = 0

    def before_launch(self, rt, first_iteration: int, n: int) -> None:
        self.looped += n > 1


def _train(loop: int, graph: bool = True, **over) -> tuple[list[float], dict, int, int]:
    counter = _CountLoops()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(hidden=256, layers=4, seq=64, micro_batch_size=2, microbatches=2, dtype="fp32", kernels="torch",
              device="cuda", iters=ITERS, seed=9, warmup_iters=2, log_every=K, graph=graph, graph_loop=loop)
    kw.update(over)
    rt = Runtime.create(RunConfig(**kw), hooks=[lambda rt: counter])
    try:
        losses = rt.train(K)  # through the capture and the first single replays
        if graph:
            assert rt.graph is not None, rt.graph_failed
            with torch.cuda.stream(rt.engine.main_stream):
                for b in rt.engine.feed.inputs + rt.engine.feed.targets:
                    b.fill_(float("nan"))  # the looped iterations must copy their data from the ring
        losses += rt.train()
        torch.cuda.synchronize()
        return losses, rt.layer_checksums(), counter.looped, rt.graph_loop
    finally:
        rt.close()


def _assert_same(got, want) -> None:
    assert got[0] == want[0], (got[0], want[0])
    assert got[1] == want[1]


@pytest.fixture(scope="module")
def one_stage():
    return _train(1)


def test_loop_equals_single_replays_bitwise(one_stage):
    looped = _train(K)
    assert looped[3] == K, "the looped graph was not built (see the runtime's notice)"
    assert looped[2] == 3, f"expected 3 looped launches (iterations 4-15), got {looped[2]}"
    assert all(map(lambda x: x == x, looped[0])), looped[0]  # no NaN: the poisoned buffers were overwritten
    assert len(set(looped[0])) == len(looped[0])  # training moves the loss
    _assert_same(looped, one_stage)


def test_loop_equals_eager(one_stage):
    eager = _train(1, graph=False)
    for a, b in zip(one_stage[0], eager[0], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (one_stage[0], eager[0])


def test_loop_with_two_stages_on_one_gpu():
    looped, plain = _train(K, stages=2), _train(1, stages=2)
    assert looped[3] == K and looped[2] == 3
    _assert_same(looped, plain)


def test_loop_with_defaults_bf16_peerline_kernels():
    over = dict(dtype="bf16", kernels="auto", hidden=512)
    looped, plain = _train(K, **over), _train(1, **over)
    assert looped[3] == K and looped[2] == 3
    _assert_same(looped, plain)


# --data counter: the data is made inside the graph from a device-side counter (distributed/counter_data.py).

@pytest.mark.parametrize("n", [1, 1000003, 1 << 20])
def test_counter_kernel_matches_torch_reference(n):
    from peerline.distributed.data import counter as counter_data
    gen = torch.Generator().manual_seed(n)
    seed, it, mb = (int(v) for v in torch.randint(0, 2**31 - 1, (3,), generator=gen))
    it_dev = torch.tensor([it], dtype=torch.int64, device="cuda")
    out = torch.full((n,), float("nan"), device="cuda")  # poisoned: the kernel must write every element
    counter_data.fill(out, seed, it_dev, mb, 1)
    want = torch.empty(n, device="cuda")
    counter_data.reference_fill(want, seed, it_dev, mb, 1)
    assert torch.isfinite(out).all()
    # Same integer hash; the float part differs by libm (cospif/logf vs torch's): 1e-5 relative plus a small
    # absolute term where cos is near its zeros.
    assert torch.allclose(out, want, rtol=1e-5, atol=2e-6), (out - want).abs().max()


def test_counter_data_loop_equals_single_replays_bitwise():
    looped, plain = _train(K, data="counter"), _train(1, data="counter")
    assert looped[3] == K and looped[2] == 3
    assert all(map(lambda x: x == x, looped[0])) and len(set(looped[0])) == len(looped[0])
    _assert_same(looped, plain)


def test_counter_data_graph_equals_eager():
    graph, eager = _train(1, data="counter"), _train(1, graph=False, data="counter")
    for a, b in zip(graph[0], eager[0], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (graph[0], eager[0])
