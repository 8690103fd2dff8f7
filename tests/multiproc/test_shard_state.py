"""ShardedAdamW over 2 CPU ranks (gloo, forked here) against torch's AdamW over whole gradients averaged by hand:
the parameters after each step, `full_state()` against the plain AdamW's state, and the round trips the
checkpoints rely on: a plain AdamW's state loaded into a fresh sharded optimizer (`load_full_state`) and a sharded
optimizer's `full_state()` loaded into a fresh plain AdamW both continue exactly as the uninterrupted reference."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from peerline.distributed.grad_sync.sharded import ShardedGradBuckets
from peerline.distributed.grad_sync.sharded_adamw import ShardedAdamW, full_param_names
from tests.helpers import forkserver

pytestmark = pytest.mark.slow

TOL = 1e-6
HYPER = {"lr": 1e-2, "weight_decay": 0.1}


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # odd sizes: parameters straddle shard boundaries, buckets need padding
    return nn.Sequential(nn.Linear(13, 40), nn.Sequential(nn.LayerNorm(40), nn.Linear(40, 7)), nn.Linear(7, 5))


def _sharded(model: nn.Sequential) -> tuple[ShardedGradBuckets, ShardedAdamW]:
    sync = ShardedGradBuckets([list(layer.parameters()) for layer in model], group=dist.group.WORLD,
                              device=torch.device("cpu"), bucket_mb=0.001, first_bucket_mb=0.0005)
    return sync, ShardedAdamW([sync], full_param_names({0: model}, {0: 2}), **HYPER)


def _batch(it: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 13, generator=torch.Generator().manual_seed(1000 * it + rank))


def _sharded_step(model, sync, opt, it: int, rank: int) -> None:
    sync.zero_grad()
    sync.arm()
    model(_batch(it, rank)).square().mean().backward()
    sync.finish()
    opt.step()


def _plain_step(model, opt, it: int, rank: int) -> None:
    opt.zero_grad()
    model(_batch(it, rank)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    opt.step()


def _differences(a: nn.Module, b: nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _state_difference(full: dict, plain: torch.optim.AdamW, names: dict) -> float:
    assert set(full) == {names[p] for p in plain.state}, (sorted(full), len(plain.state))
    worst = 0.0
    for p, st in plain.state.items():
        mine = full[names[p]]
        assert float(mine["step"]) == float(st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == st[key].shape
            worst = max(worst, float((mine[key] - st[key]).abs().max()))
    return worst


def _check(rank: int, out: dict) -> None:
    model, ref_model = _model(0), _model(0)
    sync, opt = _sharded(model)
    ref = torch.optim.AdamW(ref_model.parameters(), **HYPER)
    names = full_param_names({0: ref_model}, {0: 2})
    assert opt.full_state() == {}  # no state before the first step, as a plain AdamW
    for it in range(3):
        _sharded_step(model, sync, opt, it, rank)
        _plain_step(ref_model, ref, it, rank)
        out[f"params {it}"] = _differences(model, ref_model)
    out["full_state"] = _state_difference(opt.full_state(), ref, names)
    # unsharded -> sharded: a fresh sharded optimizer takes the plain state, the weights come as the model's
    model2 = _model(5)
    model2.load_state_dict(ref_model.state_dict())
    sync2, opt2 = _sharded(model2)
    opt2.load_full_state({names[p]: st for p, st in ref.state.items()})
    out["loaded full_state"] = _state_difference(opt2.full_state(), ref, names)
    # sharded -> unsharded: a fresh plain AdamW takes full_state() through its state_dict
    full = opt.full_state()
    plain_model = copy.deepcopy(ref_model)
    plain = torch.optim.AdamW(plain_model.parameters(), **HYPER)
    order = list(plain_model.parameters())
    plain_names = full_param_names({0: plain_model}, {0: 2})
    plain.load_state_dict({"state": {i: full[plain_names[p]] for i, p in enumerate(order)},
                           "param_groups": ref.state_dict()["param_groups"]})
    for it in range(3, 5):  # every copy continues as the uninterrupted reference
        _sharded_step(model, sync, opt, it, rank)
        _sharded_step(model2, sync2, opt2, it, rank)
        _plain_step(plain_model, plain, it, rank)
        _plain_step(ref_model, ref, it, rank)
        out[f"continued {it}"] = max(_differences(m, ref_model) for m in (model, model2, plain_model))


def _worker(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        _check(rank, out)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_sharded_adamw_matches_adamw_and_round_trips_its_state() -> None:
    ctx = forkserver()
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True,
                           start_method="forkserver")
        got = {rank: dict(v) for rank, v in results.items()}
    for rank, out in got.items():
        assert "error" not in out, (rank, out["error"])
        assert len(out) == 7, out  # 3 steps, 2 states, 2 continued steps
        bad = {k: v for k, v in out.items() if not v <= TOL}
        assert not bad, (rank, bad)
