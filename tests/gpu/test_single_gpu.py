"""GPU checks of single-GPU mode with the pinned staging feed (distributed/staging.py) and the allocator settings
(distributed/allocator.py). Skipped without CUDA.

- --stages 2 and 4 equal --stages 1 (losses per iteration from the d2h results, every layer's parameters, the
  last stage's outputs), both schedules, fp32 with TF32 off and torch kernels: the split changes no arithmetic
  inside a stage, so we ask 1e-5 relative (the lead's pipeline checks see 1e-6; 1e-5 leaves room for a cuBLAS
  algorithm chosen differently by the caching allocator's alignment, not for a wrong microbatch, which moves
  the loss by percents). The static buffers are poisoned (NaN) before the first load.
- The three streams overlap: CUDA-event timestamps of each iteration's compute span on the main stream against
  the H2D spans of the next iteration and the D2H span of the previous one.
- The async backend (cudaMallocAsync, release threshold 0) runs in a fresh process, equals the caching run, and a
  whole iteration captured into a CUDA graph under it replays to the eager losses (or the failure says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from peerline.distributed.config import RunConfig  # noqa: E402
from peerline.distributed.memory.staging import attach  # noqa: E402
from peerline.distributed.runtime import Runtime  # noqa: E402

HERE = Path(__file__).resolve().parent
RTOL = 1e-5
ITERS = 4


def _run(stages: int, schedule: str) -> tuple[list[float], dict, list[torch.Tensor], str | None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # Graphs on (the default): iterations 0-1 eager, 2-3 replayed, with the feed's load() outside the graph.
    cfg = RunConfig(hidden=64, layers=4, seq=32, micro_batch_size=2, microbatches=4, stages=stages,
                    schedule=schedule, dtype="fp32", kernels="torch", device="cuda", iters=1000, seed=5,
                    warmup_iters=2)
    rt = Runtime.create(cfg)
    try:
        for b in rt.engine.feed.inputs + rt.engine.feed.targets:
            b.fill_(float("nan"))  # poisoned: the feed must write every element
        torch.cuda.synchronize()  # the fill ran on the legacy stream, which our non-blocking streams do not wait for
        feed = attach(rt, results="outputs", keep_outputs=True)
        for _ in range(ITERS):  # back to back: the host runs ahead, the overlapped path is exercised
            rt.run_iteration()
        # drain() issues the last copy back on the main stream (not the current, legacy one) and waits for it,
        # so the last iteration has finished: its results are complete and loss_sum is final.
        results = feed.drain()
        # Runtime.read_loss clones loss_sum on the current stream; be explicit that nothing is still running.
        torch.cuda.synchronize()
        assert [r.iteration for r in results] == list(range(ITERS))
        losses = [float(r.losses.double().mean()) for r in results]
        # The engine's own loss of the last iteration agrees with the per-microbatch losses that came back.
        assert abs(rt.read_loss() - losses[-1]) <= 1e-6 * abs(losses[-1])
        graph = None if rt.graph is not None else f"capture failed: {rt.graph_failed}"
        return losses, rt.layer_checksums(), [r.outputs for r in results], graph
    finally:
        rt.engine.transport.close()


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def one_stage():
    return {s: _run(1, s) for s in ("gpipe", "1f1b")}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_equal_one_stage_with_staging_feed(one_stage, schedule, stages):
    ref_losses, ref_sums, ref_outs, _ = one_stage[schedule]
    losses, sums, outs, graph_problem = _run(stages, schedule)
    assert all(map(_close, losses, ref_losses)), (losses, ref_losses)
    assert len(set(ref_losses)) == ITERS  # training moves the loss: a stale buffer would show
    for key, (s, sq) in sums.items():
        rs, rsq = ref_sums[key]
        assert abs(s - rs) <= RTOL * max(1.0, abs(rs)) and _close(sq, rsq), (key, s, rs, sq, rsq)
    for got, want in zip(outs, ref_outs):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert graph_problem is None and one_stage[schedule][3] is None, (graph_problem, one_stage[schedule][3])


def test_h2d_compute_d2h_overlap():
    # GPU-bound (about 1 ms of kernels per layer and microbatch against ~0.15 ms of host launches) and compute a
    # bit longer than the copies (128 MiB H2D per microbatch), so a compute span is running when the copies run.
    cfg = RunConfig(hidden=256, layers=4, seq=8192, micro_batch_size=8, microbatches=4, stages=2, schedule="gpipe",
                    dtype="bf16", kernels="torch", device="cuda", iters=1000, seed=1, graph=False)
    rt = Runtime.create(cfg)
    try:
        feed = attach(rt, results="outputs", refill=False, trace=True)
        main = rt.engine.main_stream
        for _ in range(2):  # warm-up
            rt.run_iteration()
        torch.cuda.synchronize()
        feed.spans.clear()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record(main)
        compute = {}
        for it in range(2, 8):  # issued back to back, no host sync
            with torch.cuda.stream(main):
                feed.load(it)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(main)
                rt.engine.iteration()
                end.record(main)
            compute[it] = (start, end)
            rt.iteration += 1
        feed.flush()
        torch.cuda.synchronize()

        def t(ev: torch.cuda.Event) -> float:
            return ref.elapsed_time(ev)

        spans_c = {it: (t(s), t(e)) for it, (s, e) in compute.items()}
        h2d_hits, d2h_hits, h2d_total, h2d_overlapped = 0, 0, 0.0, 0.0
        for kind, it, _mb, s, e in feed.spans:
            a, b = t(s), t(e)
            if kind == "h2d" and it - 1 in spans_c:
                c0, c1 = spans_c[it - 1]  # compute of the previous iteration
                ov = max(0.0, min(b, c1) - max(a, c0))
                h2d_total += b - a
                h2d_overlapped += ov
                h2d_hits += ov > 0
            if kind == "d2h" and it + 1 in spans_c:
                c0, c1 = spans_c[it + 1]  # compute of the next iteration
                d2h_hits += min(b, c1) - max(a, c0) > 0
        report = (f"H2D spans overlapping the previous iteration's compute: {h2d_hits}, "
                  f"{h2d_overlapped:.2f} of {h2d_total:.2f} ms; D2H spans overlapping the next compute: {d2h_hits}; "
                  f"compute spans {spans_c}")
        assert h2d_hits >= 1 and d2h_hits >= 1, report
        assert h2d_overlapped >= 0.5 * h2d_total, report
    finally:
        rt.engine.transport.close()


def _worker(kind: str, threshold: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{kind}_{threshold}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    proc = subprocess.run([sys.executable, str(HERE / "workers" / "single_worker.py"), kind, threshold, str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0 and out.exists(), f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_async_allocator_run_and_graph_capture(tmp_path):
    caching = _worker("caching", "none", tmp_path)
    async_ = _worker("async", "0", tmp_path)
    assert caching["active"] == "caching" and async_["active"] == "async"
    assert async_["threshold_read"] == 0 and async_["stats"]["release_threshold"] == 0
    assert caching["allocs"] > 0  # the caching allocator counts its cudaMalloc calls
    # Graphs under cudaMallocAsync are refused up front with a reason (capture fails under it).
    assert "cudaMallocAsync" in async_.get("graph_error", ""), async_.get("graph_error")
    for res in (caching, async_):
        assert len(res["eager_losses"]) == 4
        assert all(map(_close, res["eager_losses"], caching["eager_losses"])), (res["kind"], res["eager_losses"])
    for res in (caching,):
        assert "graph_error" not in res, f"{res['kind']}: graph capture failed: {res.get('graph_traceback')}"
        assert all(map(lambda a, b: _close(a, b, 1e-6), res["graph_losses"], res["eager_losses"])), res
        for key, (s, sq) in res["graph_checksums"].items():
            es, esq = res["eager_checksums"][key]
            assert abs(s - es) <= 1e-6 * max(1.0, abs(es)) and _close(sq, esq, 1e-6), (res["kind"], key)
