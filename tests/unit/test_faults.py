"""PEERLINE_FAULT: parsing (good and bad specs), where and when each fault fires, and the non-finite policy."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.resilience import faults
from peerline.distributed.resilience.faults import Fault, Faults, FaultSpecError, parse_faults
from peerline.distributed.resilience.nonfinite import NonFiniteGuard, NonFiniteLossError, check_finite

pytestmark = pytest.mark.timeout(60)


def test_parse_examples():
    got = parse_faults("kill:rank=1:iter=3; nan:stage=1:iter=2 ;delay:rank=0:iter=2:s=1.5;"
                       "hang:stage=0:iter=4:attempt=any")
    assert got == [
        Fault("kill", 3, rank=1),
        Fault("nan", 2, stage=1),
        Fault("delay", 2, rank=0, seconds=1.5),
        Fault("hang", 4, stage=0, attempt=None),
    ]
    assert parse_faults("") == [] and parse_faults(" ; ") == []
    assert parse_faults("kill:rank=0:iter=1:code=42")[0].code == 42


@pytest.mark.parametrize("spec, needle", [
    ("explode:rank=1:iter=3", "unknown fault kind 'explode'"),
    ("kill:rank=1", "needs iter=N"),
    ("kill:iter=3", "needs rank=R or stage=S"),
    ("delay:rank=0:iter=2", "needs s=SECONDS"),
    ("kill:rank=one:iter=3", "rank='one' in 'kill:rank=one:iter=3' is not an integer"),
    ("kill:rank=1:iter=0", "iter=0 in 'kill:rank=1:iter=0' must be >= 1"),
    ("kill:rank=1:iter=3:s=2", "kill takes"),
    ("kill:rank=1:rank=2:iter=3", "'rank' given twice"),
    ("kill:rank=1:iter", "'iter' in 'kill:rank=1:iter' is not key=value"),
    ("delay:rank=0:iter=1:s=-1", "must be between 0 and 86400"),
    ("delay:rank=0:iter=1:s=abc", "is not a number of seconds"),
    ("kill:rank=0:iter=1:code=300", "must be between 1 and 255"),
])
def test_bad_specs_give_one_clear_line(spec, needle):
    with pytest.raises(FaultSpecError) as e:
        parse_faults(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("PEERLINE_FAULT: ")
    assert isinstance(e.value, ConfigError)  # printed as one line, exit 2


def test_matching_rank_stage_iteration_attempt():
    f = Fault("kill", 3, rank=1)
    assert f.matches(1, 0, 3, 0) and not f.matches(0, 0, 3, 0) and not f.matches(1, 0, 2, 0)
    assert not f.matches(1, 0, 3, 1), "a restarted job must not die again at the same place"
    assert Fault("kill", 3, rank=1, attempt=None).matches(1, 0, 3, 5)
    g = Fault("nan", 2, stage=1)
    assert g.matches(0, 1, 2, 0) and g.matches(7, 1, 2, 0) and not g.matches(1, 0, 2, 0)
    both = Fault("hang", 2, rank=3, stage=1)
    assert both.matches(3, 1, 2, 0) and not both.matches(3, 0, 2, 0)


def test_from_env_reads_restart_count():
    fs = Faults.from_env({"PEERLINE_FAULT": "kill:rank=1:iter=3", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert fs.attempt == 1 and len(fs.faults) == 1
    assert not Faults.from_env({})
    with pytest.raises(FaultSpecError):
        Faults.from_env({"PEERLINE_FAULT": "kill"})


def test_delay_sleeps_only_where_and_when_asked():
    fs = Faults(parse_faults("delay:rank=0:iter=2:s=0.3"))
    t0 = time.monotonic()
    fs.before_iteration(1, 0, 2)
    fs.before_iteration(0, 0, 1)
    assert time.monotonic() - t0 < 0.2
    fs.before_iteration(0, 0, 2)
    assert time.monotonic() - t0 >= 0.3


def test_kill_ends_the_process_with_its_code():
    code = ("from peerline.distributed.resilience import faults\n"
            "faults.before_iteration(1, 1, 2)\n"
            "faults.before_iteration(1, 1, 3)\n"
            "print('survived')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       env={**_env(), "PEERLINE_FAULT": "kill:rank=1:iter=3", "RANK": "1", "WORLD_SIZE": "2"})
    assert p.returncode == 9 and "survived" not in p.stdout
    assert "peerline: fault injected: rank 1 (stage 1) killed before iteration 3 (exit 9)" in p.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PEERLINE_FAULT"}


def test_poison_output_is_out_of_place_and_differentiable():
    faults.reset(Faults(parse_faults("nan:stage=1:iter=2")))
    try:
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        assert faults.poison_output(1, 1, y) is y
        assert faults.poison_output(0, 2, y) is y
        z = faults.poison_output(1, 2, y)
        assert torch.isnan(z).all() and not torch.isnan(y).any()
        z.sum().backward()
        assert torch.isnan(x.grad).all(), "NaN must reach backward like a real overflow would"
        assert faults.active().needs_eager()
    finally:
        faults.reset()


def test_check_finite_policy():
    assert check_finite(1.5, 3, skip=False)
    assert check_finite(float("nan"), 3, skip=True) is False
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at iteration 3; rerun with "
                                                 r"--skip-nonfinite"):
        check_finite(float("nan"), 3, skip=False)
    with pytest.raises(NonFiniteLossError, match=r"\(inf\) at iteration 2"):
        check_finite(math.inf, 5, skip=False, first_bad=2)


def _train_step(model, opt, guard, poison: bool) -> None:
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    if poison:
        loss = loss * float("nan")
    loss.backward()
    guard.update(loss.detach(), [p.grad for p in model.parameters()])
    if guard.arm(opt):
        opt.step()


@pytest.mark.parametrize("fused", [True, False])
def test_guard_skips_the_whole_step_and_records_the_first_bad_iteration(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
    guard = NonFiniteGuard(torch.device("cpu"), skip=True)
    guard.prepare(opt, completed=10)
    assert guard.skips_on_device == fused
    _train_step(model, opt, guard, poison=False)  # iteration 11
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    _train_step(model, opt, guard, poison=True)  # iteration 12: skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed in a skipped step"
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, moments[k]), f"optimizer {k} changed in a skipped step"
    _train_step(model, opt, guard, poison=False)  # iteration 13: steps again
    assert not torch.equal(model.weight, before["weight"]) and torch.isfinite(model.weight).all()
    assert guard.first_nonfinite() == 12 and guard.skipped_steps() == 1
    assert float(opt.state[model.weight]["step"]) == 2


def test_guard_without_skip_only_records():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(torch.device("cpu"), skip=False)
    guard.prepare(opt)
    _train_step(model, opt, guard, poison=False)
    assert guard.first_nonfinite() is None
    _train_step(model, opt, guard, poison=True)
    assert guard.first_nonfinite() == 2 and guard.skipped_steps() == 0
    assert torch.isnan(model.weight).all(), "without --skip-nonfinite the step is not held back"


def test_a_fault_aimed_at_a_missing_rank_or_stage_is_refused():
    from peerline.distributed.resilience.faults import check_targets

    faults = parse_faults("hang:rank=3:iter=2;nan:stage=2:iter=1")
    check_targets(faults, world_size=4, n_stages=3)
    with pytest.raises(FaultSpecError, match=r"hang aims at rank 3, but the job has 2 rank\(s\) \(0..1\)"):
        check_targets(faults, world_size=2)
    with pytest.raises(FaultSpecError, match=r"nan aims at stage 2, but the pipeline has 2 stage\(s\)"):
        check_targets(faults, world_size=4, n_stages=2)
