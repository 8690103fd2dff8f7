"""Grid layout, configuration checks, model partitioning and synthetic data."""

import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.mesh import Mesh
from peerline.distributed.model import build_default_layers, build_stages, fill_batch, split_by_weight, split_even


def test_mesh_layout_pp2_dp2():
    meshes = [Mesh(pp=2, dp=2, rank=r) for r in range(4)]
    assert [(m.stage, m.replica) for m in meshes] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert meshes[0].next_rank == 1 and meshes[0].prev_rank is None
    assert meshes[3].prev_rank == 2 and meshes[3].next_rank is None
    assert meshes[1].dp_ranks(1) == [1, 3] and meshes[2].pp_ranks(1) == [2, 3]


def test_grid_must_fit_world():
    with pytest.raises(ConfigError, match=r"pp=3 x dp=1 = 3 != world size 2"):
        RunConfig(pp=3).resolved_pp(2)
    with pytest.raises(ConfigError, match="world size 4"):
        RunConfig(dp=3).resolved_pp(4)
    assert RunConfig(dp=2).resolved_pp(4) == 2
    assert RunConfig().resolved_pp(2) == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "zigzag"}, "unknown schedule"),
    ({"microbatches": 0}, "--microbatches must be >= 1"),
    ({"global_batch": 10, "dp": 2, "microbatches": 4}, "not divisible"),
    ({"model": "nocolon"}, "package.module:factory"),
    ({"timeout_s": 0}, "--timeout-s"),
    ({"global_batch": 0}, "--global-batch must be >= 1"),
])
def test_bad_config_is_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kwargs)


def test_global_batch_sets_micro_batch_size():
    assert RunConfig(global_batch=16, dp=2, microbatches=4).micro_batch_size == 2


def test_split_even():
    assert split_even(8, 2) == [(0, 4), (4, 8)]
    assert split_even(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ConfigError):
        split_even(2, 3)


def test_split_by_weight_balances_and_keeps_every_stage():
    bounds = split_by_weight([10, 10, 10, 30], 2)
    assert bounds == [(0, 3), (3, 4)]
    assert split_by_weight([1, 100, 1, 1], 3) in ([(0, 1), (1, 2), (2, 4)], [(0, 2), (2, 3), (3, 4)])
    assert all(b > a for a, b in split_by_weight([0, 0, 0, 0, 0], 5))


def test_stage_weights_do_not_depend_on_the_split():
    cfg = RunConfig(hidden=16, layers=4)
    whole = build_default_layers(cfg, 0, 4, "torch")
    tail = build_default_layers(cfg, 2, 4, "torch")
    for a, b in zip(whole[2:], tail):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def _not_sequential():
    return nn.Linear(2, 2)


def _sequential():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 32), nn.Linear(32, 8))


def test_user_factory_must_return_sequential():
    with pytest.raises(ConfigError, match="returned Linear; a factory returns an nn.Sequential"):
        build_stages(RunConfig(model=f"{__name__}:_not_sequential"), 1, [0], "torch")
    with pytest.raises(ConfigError, match="cannot load"):
        build_stages(RunConfig(model="no.such.module:f"), 1, [0], "torch")


def test_user_model_split_by_parameters():
    stages, bounds = build_stages(RunConfig(model=f"{__name__}:_sequential"), 2, [0, 1], "torch")
    assert bounds[0][0] == 0 and bounds[-1][1] == 4 and len(stages) == 2


def test_synthetic_data_is_deterministic_and_distinct():
    g = torch.Generator()
    a, b, c = (torch.empty(3, 4) for _ in range(3))
    fill_batch(a, 0, 1, 2, 0, g)
    fill_batch(b, 0, 1, 2, 0, g)
    fill_batch(c, 0, 1, 3, 0, g)
    assert torch.equal(a, b) and not torch.equal(a, c)


def _module_list(hidden: int):
    return [nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)]


def _mixed(hidden: int):
    return [nn.Linear(hidden, hidden), lambda: nn.Linear(hidden, hidden)]


def _with_a_number(hidden: int):
    return [lambda: nn.Linear(hidden, hidden), 3]


def _empty():
    return []


def test_a_list_of_modules_is_a_model_and_other_lists_say_what_a_factory_returns():
    stages, bounds = build_stages(RunConfig(model=f"{__name__}:_module_list", hidden=8), 2, [0, 1], "torch")
    assert bounds[-1][1] == 4 and sum(len(s) for s in stages) == 4  # split by parameters, like an nn.Sequential
    for factory, what in (("_mixed", "a list that mixes nn.Modules (item 0) and builders (item 1)"),
                          ("_with_a_number", "a list whose item 1 is int, neither an nn.Module nor a builder"),
                          ("_empty", "an empty list"), ("_not_sequential", "Linear")):
        with pytest.raises(ConfigError) as info:
            build_stages(RunConfig(model=f"{__name__}:{factory}", hidden=8), 1, [0], "torch")
        assert str(info.value) == (f"model factory '{__name__}:{factory}' returned {what}; a factory returns an "
                                   "nn.Sequential, a list of nn.Modules (the layers, in order), or a list of layer "
                                   "builders (functions without arguments that return one nn.Module each; each rank "
                                   "calls only those of its own layers)")
