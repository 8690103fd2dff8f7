"""Issue 31's bad inputs, checked without a job: a layer builder that raises (its rank named), a parameter shared
by two stages, a user loss that returns something training cannot use, a diverging loss, an absurd deadline, and
the `at=end` fault the grid-fault cases use."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.env import RankConfigError
from peerline.distributed.model import build_stages, check_loss, loss_check
from peerline.distributed.resilience.faults import Fault, Faults, FaultSpecError, parse_faults
from peerline.distributed.resilience.nonfinite import LossDivergedError, NonFiniteLossError, check_growth


def _builders(hidden: int):
    def ok():
        return nn.Linear(hidden, hidden)

    def bad():
        raise ValueError("no layer 3 today")
    return [ok, ok, ok, bad]


def test_a_layer_builder_that_raises_names_its_rank_and_stage():
    """Builders run on their own rank only: the error is that rank's (RankConfigError: it prints its own line)."""
    cfg = RunConfig(model=f"{__name__}:_builders", hidden=8, layers=4)
    assert len(build_stages(cfg, 2, [0], "torch")[0]) == 1  # stage 0 builds layers 0-1 only
    with pytest.raises(RankConfigError) as e:
        build_stages(cfg, 2, [1], "torch")
    assert str(e.value) == ("rank 0 (stage 1): layer builder 3 of model factory " f"'{__name__}:_builders' raised "
                            "ValueError: no layer 3 today")


def _shared_across(hidden: int):
    a, b = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
    b.weight = a.weight
    return nn.Sequential(a, nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), b)


def _shared_within(hidden: int):
    a, b = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
    b.weight = a.weight
    return nn.Sequential(a, b, nn.Linear(hidden, hidden), nn.Linear(hidden, hidden))


def _shared_builders(hidden: int):
    shared = nn.Linear(hidden, hidden)
    return [lambda: shared, lambda: nn.Linear(hidden, hidden), lambda: nn.Linear(hidden, hidden), lambda: shared]


def test_a_parameter_shared_by_two_stages_is_refused():
    """Two stages would each train their own copy of it (silently untied); within one stage autograd sums."""
    cfg = RunConfig(model=f"{__name__}:_shared_across", hidden=8, layers=4)
    with pytest.raises(ConfigError, match=r"layers 0 and 3 of .* share one parameter \(layer 0's 'weight' is layer "
                                          r"3's 'weight'\), but they sit on different stages \(0 and 1\)"):
        build_stages(cfg, 2, [0], "torch")
    with pytest.raises(ConfigError, match="--tie-embeddings"):
        build_stages(cfg, 2, [0, 1], "torch")  # --stages 2 on one device: the same two copies
    build_stages(RunConfig(model=f"{__name__}:_shared_within", hidden=8, layers=4), 2, [0], "torch")
    build_stages(cfg, 1, [0], "torch")  # one stage holds both
    with pytest.raises(RankConfigError, match=r"rank 0 \(stages 0, 1\): layers 0 and 3 .* share one parameter "
                                              r"\(layer 0's 'weight' is layer 3's 'weight'\)"):
        build_stages(RunConfig(model=f"{__name__}:_shared_builders", hidden=8, layers=4), 2, [0, 1], "torch")


@pytest.mark.parametrize("fn,match", [
    (lambda out, tgt: ((out - tgt) ** 2).mean(dim=-1), r"returned float32 \[2, 4\] for output float32 \[2, 4, 8\] "
                                                        r"and target float32 \[2, 4, 8\], not one value"),
    (lambda out, tgt: ((out - tgt) ** 2).mean().long(), r"returned int64 \[\] .*no gradient flows back through an "
                                                         "integer"),
    (lambda out, tgt: torch.tensor(float(((out - tgt) ** 2).mean().detach())),
     "returned a loss that does not depend on the output"),
    (lambda out, tgt: float(((out - tgt) ** 2).mean()), "returned float for output"),
    (lambda out, tgt: tgt.labels, r"raised AttributeError: .* for output float32 \[2, 4, 8\]"),
])
def test_a_user_loss_that_training_cannot_use_is_one_line_naming_it(fn, match):
    out = torch.randn(2, 4, 8).requires_grad_()
    with pytest.raises(ConfigError, match="the loss function 'pkg.losses:fn' " + match):
        check_loss("pkg.losses:fn", fn, out, torch.randn(2, 4, 8))


def test_the_start_up_loss_check_uses_the_runs_targets():
    def labels_loss(out, tgt):
        assert tgt.dtype == torch.int64 and tuple(tgt.shape) == (2, 4)
        return nn.functional.cross_entropy(out.flatten(0, 1), tgt.flatten())

    cfg = RunConfig(model="gpt", loss="pkg.losses:ce", micro_batch_size=2, seq=4)
    loss_check(cfg, labels_loss)(torch.randn(2, 4, 16))  # next-token labels [B, T]: fine
    assert loss_check(RunConfig(), lambda o, t: o) is None  # built-in losses are not checked


def test_a_diverging_loss_stops_the_run():
    check_growth(1500.0, 3, (1, 2.0), 1000.0)  # 750 x: fine
    check_growth(1e12, 3, (1, 2.0), 0.0)  # off
    with pytest.raises(LossDivergedError, match=r"the loss diverged: 2500 at iteration 3 is over 1000 times the "
                                                r"first logged loss \(2 at iteration 1\); lower --lr"):
        check_growth(2500.0, 3, (1, 2.0), 1000.0)
    assert issubclass(LossDivergedError, NonFiniteLossError)  # the failsafe stops every rank alike, rank 0 prints
    with pytest.raises(ConfigError, match="--max-loss-growth must be above 1"):
        RunConfig(max_loss_growth=0.5)


@pytest.mark.parametrize("seconds", [0.001, 0.5])
def test_an_absurd_deadline_is_refused_with_the_minimum(seconds):
    with pytest.raises(ConfigError, match=rf"--timeout-s {seconds:g} is too short: the deadline must be at least 1 s"):
        RunConfig(timeout_s=seconds)
    assert RunConfig(timeout_s=1).timeout_s == 1


def test_a_fault_at_the_end_of_an_iteration():
    (f,) = parse_faults("kill:rank=3:iter=2:at=end")
    assert f == Fault("kill", 2, rank=3, at="end")
    assert f.matches(3, 1, 2, 0, at="end") and not f.matches(3, 1, 2, 0)
    Faults([f]).before_iteration(3, 1, 2)  # not before it
    with pytest.raises(FaultSpecError, match="at='middle'"):
        parse_faults("stop:rank=0:iter=1:at=middle")
    with pytest.raises(FaultSpecError, match="nan takes"):
        parse_faults("nan:stage=0:iter=1:at=end")


def test_a_weight_shared_within_one_stage_is_stepped_once(tmp_path, monkeypatch):
    """Two layers of one stage sharing a weight train it as one parameter: the optimizer holds it once (torch's
    AdamW would otherwise apply two updates a step)."""
    from peerline.distributed.runtime import Runtime

    monkeypatch.chdir(tmp_path)
    rt = Runtime.create(RunConfig(model=f"{__name__}:_shared_within", hidden=8, layers=4, device="cpu", iters=2))
    try:
        params = [p for g in rt.engine.optimizer.param_groups for p in g["params"]]
        assert len(params) == len({id(p) for p in params})
        shared = rt.engine.stages[0].module[0].weight
        assert sum(p is shared for p in params) == 1
        before = shared.detach().clone()
        rt.train(1)
        assert not torch.equal(before, shared.detach())
    finally:
        rt.close()
