"""GPU checks of the timing pieces of the benchmark suite: CUDA-event timelines on real streams, the block timer,
and the stage-time measurement behind the ideal time. One GPU; skipped without CUDA."""

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


_CYCLES_PER_MS: list[float] = []


def _sleep_ms(ms: float) -> None:
    """Busy the current stream for about `ms`: torch.cuda._sleep spins for a number of clock cycles, calibrated
    once against CUDA events (clock rates vary with boost)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up: the first launch loads the kernel
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


@pytest.fixture(autouse=True)
def calibrated_sleep():
    _sleep_ms(0)  # calibrate outside the timed regions
    torch.cuda.synchronize()


def test_timeline_on_two_streams_orders_dependent_spans():
    from peerline.distributed.observe.timeline import Timeline
    from peerline.distributed.observe.timeline_check import check_spans
    from peerline.distributed.streams import create_rank_streams, use

    dev = torch.device("cuda", 0)
    streams = create_rank_streams(dev, local_stages=2)
    a, b = streams.stage_compute
    tl = Timeline(rank=0, enabled=True)
    torch.cuda.synchronize()
    tl.start_iteration(a)
    for mb in range(3):  # stage 0 on stream a, stage 1 on stream b after it: a two-stage pipeline on one GPU
        with use(a), tl.span("compute0", f"F{mb}", a):
            _sleep_ms(1.0)
        done = torch.cuda.Event()
        done.record(a)
        b.wait_event(done)
        with use(b), tl.span("compute1", f"F{mb}", b):
            _sleep_ms(1.0)
    for mb in range(3):
        with use(b), tl.span("compute1", f"B{mb}", b):
            _sleep_ms(0.5)
        done = torch.cuda.Event()
        done.record(b)
        a.wait_event(done)
        with use(a), tl.span("compute0", f"B{mb}", a):
            _sleep_ms(0.5)
    before = time.time() * 1e3
    spans = tl.gather()[0]
    assert len(spans) == 12
    assert all(s.end_ms > s.start_ms >= -1e-3 for s in spans)
    f0 = [s for s in spans if s.label == "F0"]
    assert len(f0) == 2 and f0[1].start_ms >= f0[0].end_ms - 1e-3
    # a 1 ms sleep kernel takes roughly 1 ms (clock rates vary with boost: loose bounds)
    assert 0.2 < f0[0].duration_ms < 10, f0[0]
    assert check_spans({0: spans}, pp=1, stages_per_rank=2, tol_ms=0.0) == []
    # The origin is dated in host time: before the gather began, and not long before.
    assert before - 5_000 < tl.origin_host_ms <= before + 1


def test_time_blocks_times_device_work_per_iteration():
    from peerline.bench.benchkit import time_blocks

    dev = torch.device("cuda", 0)
    t = time_blocks(lambda n: [_sleep_ms(2.0) for _ in range(n)], iters=4, reps=3, warmup=1, device=dev)
    assert t.reps == 3 and 0.5 < t.median_ms < 20, t
    # four 2 ms kernels are issued in far less than 8 ms: most of the block is still queued when the host is done
    assert t.host_lead_ms is not None and 2.0 < t.host_lead_ms < 80, t


def test_stage_time_measurement_bf16():
    from peerline.bench.suites.torch_pipelining import PipeShape, build_stage_module, measure_stage_ms

    shape = PipeShape("small", layers=4, hidden=512, micro_batch_size=2, seq=256, microbatches=4, dtype="bf16")
    dev = torch.device("cuda", 0)
    module = build_stage_module(shape, 2, 1).to(dev)
    fwd, bwd = measure_stage_ms(module, shape, dev, is_first=False, is_last=True, warmup=2, reps=5)
    assert 0 < fwd < 50 and 0 < bwd < 100, (fwd, bwd)
    assert all(p.grad is None for p in module.parameters())
