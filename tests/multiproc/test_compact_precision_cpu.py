"""`--precision compact` jobs on the CPU: one process and pp=2 (forked ranks, gloo) train with finite losses and
the same losses and checksums (within 1e-5); a checkpoint holds the int16 master remainders and bf16 moments, and
a resumed run continues exactly as the uninterrupted one (losses and every layer's checksums)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from peerline.distributed.resilience import dcp_io
from tests.helpers import TINY, assert_same_run, forkrun_cmd, run_job

pytestmark = pytest.mark.timeout(300)

COMPACT = [*TINY, "--precision", "compact", "--log-every", "1"]


def _ok(launcher: list[str], args: list[str], tmp_path, name: str) -> dict:
    proc, res = run_job(launcher, args, tmp_path, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res is not None and all(math.isfinite(x) for x in res["losses"]), res
    return res


def test_compact_trains_in_one_process_and_on_two_stages(tmp_path) -> None:
    one = _ok([sys.executable], [*COMPACT, "--iters", "4"], tmp_path, "one")
    two = _ok(forkrun_cmd(2), [*COMPACT, "--iters", "4", "--pp", "2"], tmp_path, "two")
    assert len(one["losses"]) == 4 and one["losses"][-1] < one["losses"][0]
    assert one["config"]["precision"] == "compact"
    assert_same_run(two, one)  # the same model, data and update, split over two ranks


def test_checkpoint_keeps_the_remainders_and_resume_continues_exactly(tmp_path) -> None:
    _ok([sys.executable], [*COMPACT, "--iters", "2", "--save", "ck"], tmp_path, "first")
    specs = dcp_io.tensor_specs(dcp_io.read_metadata(tmp_path / "ck" / "iter_000002"))
    remainders = {k: dt for k, (_, dt) in specs.items() if k.endswith(".master_remainder")}
    moments = {k: dt for k, (_, dt) in specs.items() if k.endswith(".exp_avg")}
    assert remainders and set(remainders.values()) == {torch.int16}, specs
    assert len(moments) == len(remainders) and set(moments.values()) == {torch.bfloat16}
    resumed = _ok([sys.executable], [*COMPACT, "--iters", "4", "--resume", "ck"], tmp_path, "resumed")
    whole = _ok([sys.executable], [*COMPACT, "--iters", "4"], tmp_path, "whole")
    assert resumed["iterations"] == [3, 4]
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["layer_checksums"] == whole["layer_checksums"]
