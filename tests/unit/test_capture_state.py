"""kernels/capture_state.py: `capturing()` answers False inside `eager_only()` without asking the driver, asks torch
everywhere else, and the runtime runs each eager iteration (never a capture or a replay) inside `eager_only()`.
The driver's answer is mocked: the CPU cannot capture."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.attention import SDPBackend

from peerline.kernels import capture_state, rope
from peerline.models.rope import rope_tables
from tests.unit.test_hooks import fake_runtime


@pytest.fixture
def driver_says_capturing(monkeypatch):
    """torch's query answers True (as inside a capture) and counts its calls."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or True)
    return asked


def test_outside_eager_only_the_driver_answers(driver_says_capturing):
    assert capture_state.capturing() is True
    assert len(driver_says_capturing) == 1


def test_eager_only_answers_without_asking_nests_and_ends_on_error(driver_says_capturing):
    with capture_state.eager_only():
        assert capture_state.capturing() is False
        with capture_state.eager_only():
            assert capture_state.capturing() is False
        assert capture_state.capturing() is False  # the outer region still holds
    assert driver_says_capturing == []
    with pytest.raises(RuntimeError), capture_state.eager_only():
        raise RuntimeError("boom")
    assert capture_state.capturing() is True  # the region ended with the error


def test_eager_only_is_per_thread(driver_says_capturing):
    seen = []
    with capture_state.eager_only():
        worker = threading.Thread(target=lambda: seen.append(capture_state.capturing()))
        worker.start()
        worker.join()
    assert seen == [True]  # another thread may capture while this one runs eagerly


def test_without_cuda_nothing_captures(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("asked without CUDA"))
    assert capture_state.capturing() is False


@pytest.mark.parametrize("graph_loop", [0, 1, 4])
def test_runtime_runs_eager_iterations_and_only_those_inside_eager_only(driver_says_capturing, graph_loop):
    """Eager launches see capturing() False without a query; graph replays and looped launches run outside."""
    events: list = []
    rt = fake_runtime(events, [], loop=graph_loop, iters=8, log_every=4)
    rt.engine.iteration = lambda: events.append(("engine", capture_state.capturing()))
    rt.train()
    eager = [e for e in events if e[0] == "engine"]
    if graph_loop:
        assert eager == [] and any(e[0] == "graph" for e in events)
    else:
        assert eager == [("engine", False)] * 8
    assert capture_state.capturing() is True  # nothing left open after training


def test_auto_runs_cudnn_by_its_direct_route(monkeypatch):
    """auto whose pick is cuDNN calls the attention ops itself (CPU flash stand-ins here), never SDPA with a kept
    graph; its output and input gradient equal the unfused reference."""
    monkeypatch.setattr(rope, "resolve_backend", lambda name, q, k, v: SDPBackend.CUDNN_ATTENTION)
    monkeypatch.setattr(rope, "_sdpa_forward", lambda *a, **k: pytest.fail("auto's cuDNN pick went through SDPA"))
    assert rope.runs_direct("auto", SDPBackend.CUDNN_ATTENTION) and rope.runs_direct("auto", None)
    assert not rope.runs_direct("cudnn", SDPBackend.CUDNN_ATTENTION)
    assert not rope.runs_direct("auto", SDPBackend.EFFICIENT_ATTENTION)
    batch, seq, heads, dim = 2, 12, 2, 8
    cos, sin = (t.double() for t in rope_tables(seq, dim))
    qkv = torch.randn(batch, seq, 3 * heads * dim, dtype=torch.float64)
    dy = torch.randn(batch, seq, heads * dim, dtype=torch.float64)
    ref_in = qkv.clone().requires_grad_(True)
    rope.attention_reference(ref_in, cos, sin, heads).backward(dy)
    fused_in = qkv.clone().requires_grad_(True)
    out = rope.FusedRopeAttention.apply(fused_in.clone(), cos, sin, heads, "auto")
    out.backward(dy)
    torch.testing.assert_close(out, rope.attention_reference(qkv.clone(), cos, sin, heads), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused_in.grad, ref_in.grad, rtol=1e-10, atol=1e-10)
