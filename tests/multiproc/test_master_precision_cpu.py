"""`--dtype bf16 --precision master` jobs on the CPU (gloo): the bf16 recipe's model with MasterAdamW's fp32 masters
and moments (grad_sync/master_adamw.py).

A pipeline of it (GPT and residual MLP, 1F1B and the zero-bubble split, forked pp=2) equals one process of the same
recipe, model and seed (1e-6: the checksums' own float64 sums), as --precision bf16's do; it differs from the pure
bf16 recipe by rounding only (2e-2); a checkpoint holds fp32 masters and moments and a resumed run continues bit
for bit; an autocast (fp32 weights) checkpoint resumes under master with its weights as the masters exactly and a
master checkpoint under autocast; export_checkpoint writes the fp32 masters; --shard-optimizer with it is one
error line naming --precision autocast, exit 2, before any process group.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from peerline.distributed.resilience import dcp_io
from peerline.launch import export_checkpoint
from tests.helpers import TINY, assert_same_run, forkrun_cmd, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

GPT = ["--model", "gpt", "--heads", "4", *TINY]
MASTER = ["--dtype", "bf16", "--precision", "master"]


def _ok(launcher: list[str], args: list[str], tmp_path, name: str) -> dict:
    proc, res = run_job(launcher, args, tmp_path, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res is not None and all(math.isfinite(x) for x in res["losses"]), res
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return {name: _ok([sys.executable], [*model, "-m", "4", *MASTER], tmp, f"ref_{name}")
            for name, model in (("gpt", GPT), ("mlp", TINY))}


@pytest.mark.parametrize("model", ["gpt", "mlp"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_master_pp2_equals_single_process(tmp_path, reference, model, schedule) -> None:
    args = GPT if model == "gpt" else TINY
    res = _ok(forkrun_cmd(2), [*args, "-m", "4", "--pp", "2", "--schedule", schedule, *MASTER], tmp_path, "pp2")
    assert res["world_size"] == 2 and res["config"]["precision"] == "master"
    assert_same_run(res, reference[model], rtol=1e-6)


def test_master_differs_from_bf16_only_by_rounding(tmp_path, reference) -> None:
    bf16 = _ok([sys.executable], [*GPT, "-m", "4", "--precision", "bf16"], tmp_path, "bf16")["losses"]
    master = reference["gpt"]["losses"]
    assert bf16[0] == master[0], "the same bf16 model before the first update"
    assert bf16 != master, "the recipes must differ (bf16 AdamW rounds its weights and moments)"
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(bf16, master)), (bf16, master)


def test_checkpoint_keeps_fp32_masters_and_resume_continues_exactly(tmp_path) -> None:
    args = [*TINY, *MASTER, "--log-every", "1"]
    _ok([sys.executable], [*args, "--iters", "2", "--save", "ck"], tmp_path, "first")
    specs = dcp_io.tensor_specs(dcp_io.read_metadata(tmp_path / "ck" / "iter_000002"))
    masters = {k: dt for k, (_, dt) in specs.items() if k.endswith(".master")}
    moments = {k: dt for k, (_, dt) in specs.items() if k.endswith(".exp_avg")}
    weights = {k: dt for k, (_, dt) in specs.items() if k.startswith("model.") and k.endswith(".weight")}
    assert masters and set(masters.values()) == {torch.float32}, specs
    assert len(moments) == len(masters) and set(moments.values()) == {torch.float32}
    assert set(weights.values()) == {torch.bfloat16}
    resumed = _ok([sys.executable], [*args, "--iters", "4", "--resume", "ck"], tmp_path, "resumed")
    whole = _ok([sys.executable], [*args, "--iters", "4"], tmp_path, "whole")
    assert resumed["iterations"] == [3, 4]
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["layer_checksums"] == whole["layer_checksums"]
    # export: the fp32 masters, not their bf16 roundings
    assert export_checkpoint.main([str(tmp_path / "ck"), "--to", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt")
    key = next(k for k in masters)[len("optim."):-len(".master")]
    assert exported[key].dtype == torch.float32
    stored = {f"optim.{key}.master": torch.empty_like(exported[key])}
    dcp_io.load(stored, tmp_path / "ck" / "iter_000002")
    assert torch.equal(exported[key], stored[f"optim.{key}.master"])
    assert any(not torch.equal(v, v.bfloat16().float()) for v in exported.values() if v.is_floating_point())


def test_checkpoints_of_other_recipes_resume_under_master_and_back(tmp_path) -> None:
    autocast = [*TINY, "--dtype", "bf16", "--precision", "autocast", "--log-every", "1"]
    _ok([sys.executable], [*autocast, "--iters", "2", "--save", "ac"], tmp_path, "autocast")
    specs = dcp_io.tensor_specs(dcp_io.read_metadata(tmp_path / "ac" / "iter_000002"))
    assert {dt for k, (_, dt) in specs.items() if k.startswith("model.")} == {torch.float32}
    res = _ok([sys.executable], [*TINY, *MASTER, "--iters", "3", "--resume", "ac", "--save", "m"], tmp_path, "m")
    assert res["iterations"] == [3]
    back = _ok([sys.executable], [*autocast, "--iters", "4", "--resume", "m"], tmp_path, "back")
    assert back["iterations"] == [4]
    _ok([sys.executable], [*TINY, "--precision", "compact", "--iters", "2", "--save", "c"], tmp_path, "compact")
    res = _ok([sys.executable], [*TINY, *MASTER, "--iters", "3", "--resume", "c"], tmp_path, "from_compact")
    assert res["iterations"] == [3]


def test_compact_with_shard_optimizer_is_one_error_line(tmp_path) -> None:
    """master shards (tests/multiproc/test_shard_optimizer.py); compact does not yet, and says so in one line."""
    args = [*TINY, "--dtype", "bf16", "--precision", "compact", "--shard-optimizer", "--dp", "2"]
    proc, _ = run_job([sys.executable], args, tmp_path, "shard")
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert lines == ["peerline: error: --precision compact does not support --shard-optimizer yet (its optimizer "
                     "keeps every parameter's master remainder and moments whole); use --precision master with it"], \
        lines
