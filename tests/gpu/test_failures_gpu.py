"""Failure behaviour on GPUs: the non-finite guard inside a CUDA graph, a checkpoint of CUDA state, and
on two GPUs (NCCL / copy engine) a killed rank, a hung rank (the peer's stream spins on a flag that never comes),
resume == uninterrupted, and --skip-nonfinite. Skipped without CUDA (two devices for the multi-rank tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience.nonfinite import NonFiniteGuard
from tests.gpu.jobs import fault_env
from tests.multiproc.failures_util import STARTUP_S, losses, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_2 = pytest.mark.gpu2  # skipped with fewer than 2 CUDA devices (tests/gpu/conftest.py)

# Small model, torch kernels (no NVRTC compile inside the first watched iteration), fp32 so resumed losses can be
# compared closely.
MODEL = ["--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "-m", "4", "--kernels", "torch",
         "--dtype", "fp32"]
DEADLINE = 10




def run2(args: list[str], tmp: Path, fault: str = "", limit_s: float = STARTUP_S + 90):
    return spawn(2, [*MODEL, *args], tmp, fault_env(fault), limit_s)


@needs_cuda
def test_guard_skips_the_step_inside_a_cuda_graph():
    """update + arm + fused AdamW step captured once; replays with finite, NaN, finite gradients."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True, capturable=True)
    loss = torch.zeros((), device=dev)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    guard = NonFiniteGuard(dev, skip=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        guard.prepare(opt)
        for _ in range(3):  # warm-up: optimizer state exists before capture
            guard.update(loss, [p.grad for p in model.parameters()])
            guard.arm(opt)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        guard.update(loss, [p.grad for p in model.parameters()])
        assert guard.arm(opt)
        opt.step()
    torch.cuda.synchronize()
    guard.count.fill_(10)
    guard.first_bad.fill_(math.inf)
    w0 = model.weight.detach().clone()
    graph.replay()
    w1 = model.weight.detach().clone()
    assert not torch.equal(w0, w1), "a finite step changed nothing"
    loss.fill_(float("nan"))
    graph.replay()
    assert torch.equal(model.weight, w1), "the step with a NaN loss was applied"
    loss.zero_()
    model.bias.grad[3] = float("inf")
    graph.replay()
    assert torch.equal(model.weight, w1), "the step with an inf gradient was applied"
    model.bias.grad[3] = 0.0
    graph.replay()
    assert not torch.equal(model.weight, w1) and torch.isfinite(model.weight).all()
    assert guard.first_nonfinite() == 12 and guard.skipped_steps() == 2


@needs_cuda
def test_checkpoint_of_cuda_state_round_trips(tmp_path):
    """DCP checkpoint of CUDA weights, fused capturable AdamW state (step on the device) and the CUDA RNG, loaded
    by name into another model on the device."""
    from peerline.distributed.resilience import checkpoint_names as names
    from peerline.distributed.resilience import checkpoint_store as store

    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, device=dev))
    opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    model(torch.randn(4, 32, device=dev)).sum().backward()
    opt.step()
    torch.cuda.manual_seed(3)
    rng = ckpt.capture_rng(dev)
    want = torch.rand(5, device=dev)
    stages = [(model, 0)]
    state = {names.MODEL + k: v for k, v in names.stage_modules(stages).items()}
    state.update(names.flatten_optimizer(names.optimizer_state(opt, names.param_names(stages))))
    state.update({f"rng.0.{k}": v for k, v in rng.items()})
    manifest = {"model": {"layers": 1}}
    ckpt.save_checkpoint(tmp_path, 0, 1, state, manifest)
    other = torch.nn.Sequential(torch.nn.Linear(32, 32, device=dev))
    other_opt = torch.optim.AdamW(other.parameters(), fused=True, capturable=True)
    dst = [(other, 0)]
    pn = names.param_names(dst)

    def template(shapes):
        found = {names.MODEL + k: v for k, v in names.stage_modules(dst).items()}
        found.update(names.flatten_optimizer(names.optimizer_template(((n, p) for p, n in pn.items()), shapes)))
        found.update({f"rng.0.{k}": torch.empty_like(v, device="cpu") for k, v in rng.items()})
        return found
    torch.cuda.manual_seed(99)
    loaded = store.resume(tmp_path, None, 0, 1, manifest, print, template)
    full = {}
    for k, v in loaded.tensors.items():
        if k.startswith(names.OPTIM):
            name, entry = k[len(names.OPTIM):].rsplit(".", 1)
            full.setdefault(name, {})[entry] = v
    names.load_optimizer_state(other_opt, pn, full)
    ckpt.restore_rng({k[len("rng.0."):]: v for k, v in loaded.tensors.items() if k.startswith("rng.0.")}, dev)
    assert torch.equal(other[0].weight, model[0].weight) and other[0].weight.device.type == "cuda"
    st = other_opt.state[other[0].weight]
    assert torch.equal(st["exp_avg"], opt.state[model[0].weight]["exp_avg"]) and st["step"].device.type == "cuda"
    assert torch.equal(torch.rand(5, device=dev), want), "CUDA RNG state not restored"


@needs_2
@pytest.mark.parametrize("p2p", ["nccl", "copy-engine"])
def test_killed_rank_ends_every_rank(tmp_path, p2p):
    ranks = run2(["--p2p", p2p, "--iters", "8", "--timeout-s", str(DEADLINE)], tmp_path,
                 fault="kill:rank=1:iter=4", limit_s=STARTUP_S + DEADLINE + 60)
    r0, r1 = ranks
    assert r1.rc == 9, r1.err[-2000:]
    assert r0.rc != 0, r0.err[-2000:]
    # The survivor ends by our watchdog (one line naming rank 1) or, if it wins the race, NCCL's own timeout.
    assert r0.seconds < STARTUP_S + DEADLINE + 45
    if r0.errors():
        assert len(r0.errors()) == 1 and "rank 1" in r0.errors()[0], r0.err[-2000:]


@needs_2
def test_hung_rank_peer_stream_spinning_is_ended_by_the_watchdog(tmp_path):
    ranks = run2(["--p2p", "copy-engine", "--iters", "8", "--timeout-s", str(DEADLINE)], tmp_path,
                 fault="hang:rank=1:iter=6", limit_s=STARTUP_S + DEADLINE + 60)
    r0, r1 = ranks
    # The hung rank names itself: its own watchdog fires while it waits on nothing (resilience/watchdog.py).
    assert r1.rc == 3 and len(r1.errors()) == 1, r1.err[-2000:]
    assert r1.errors()[0].startswith(f"peerline: error: rank 1 (stage 1) timed out after {DEADLINE} s waiting for "
                                     "iteration 6 to finish; this rank stopped in iteration 6: no progress for "), \
        r1.err[-2000:]
    assert r1.errors()[0].endswith("waiting for no other rank"), r1.err[-2000:]
    # Iteration 6 is a graph replay (captured at iteration 4, after 3 eager warm-ups): rank 0's device spins on the
    # flag of a gradient rank 1 never sends, and its line (unless rank 1's exit ended it first, through NCCL) names
    # that edge and microbatch (resilience/exchange_watch.py, describe_stall: the events recorded after each receive,
    # replayed by the graph). A hang before the capture leaves rank 0's host in the pre-capture barrier instead,
    # with no receive queued: then the line names the peers only.
    assert r0.rc != 0, r0.err[-2000:]
    print("rank 0:", r0.rc, r0.errors())  # kept in the log (-rA): which way rank 0 ended
    if r0.errors():
        line = r0.errors()[0]
        assert len(r0.errors()) == 1 and "from rank 1 (edge stage 1->0)" in line, r0.err[-2000:]
        assert " mb " in line and "the device is stuck there" in line, r0.err[-2000:]


@needs_2
def test_resume_matches_uninterrupted_with_graphs(tmp_path):
    """The GPU default (CUDA graphs, copy engine); the resumed process captures after its own warm-up."""
    common = ["--p2p", "copy-engine", "--graph", "--warmup-iters", "2", "--timeout-s", "120"]
    for name, extra in (("full", ["--iters", "6"]), ("first", ["--iters", "3", "--save", "ck"]),
                        ("resumed", ["--iters", "6", "--resume", "ck"])):
        ranks = run2([*common, *extra, "--json", f"{name}.json"], tmp_path)
        assert all(r.rc == 0 for r in ranks), f"{name}: " + ranks[0].err[-2000:] + ranks[1].err[-2000:]
    full = losses(tmp_path / "full.json")
    assert losses(tmp_path / "first.json") == full[:3]
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["iterations"] == [4, 5, 6]
    for got, want in zip(resumed["losses"], full[3:], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed["losses"], full[3:])


@needs_2
def test_skip_nonfinite_on_gpus(tmp_path):
    ranks = run2(["--p2p", "copy-engine", "--iters", "4", "--skip-nonfinite", "--json", "skip.json"], tmp_path,
                 fault="nan:stage=1:iter=2")
    assert all(r.rc == 0 for r in ranks), ranks[0].err[-2000:] + ranks[1].err[-2000:]
    got = losses(tmp_path / "skip.json")
    assert math.isnan(got[1]) and all(math.isfinite(v) for v in (got[0], *got[2:])), got
    ranks = run2(["--p2p", "copy-engine", "--iters", "4"], tmp_path, fault="nan:stage=1:iter=2")
    assert [r.rc for r in ranks] == [1, 1]
    assert ranks[0].errors() == ["peerline: error: non-finite loss (nan) at iteration 2; rerun with "
                                 "--skip-nonfinite to skip such steps"], ranks[0].err[-2000:]
