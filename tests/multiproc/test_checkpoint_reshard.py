"""Checkpoints reshard across grids (gloo, CPU): a run saved on one grid resumes on another, pp=2 -> pp=1, pp=1 ->
pp=2 and dp=2 -> dp=1 (the same global batch: 1 x 2 microbatches per replica, then 2 on one), a sharded optimizer
(--shard-optimizer, dp=2) -> an unsharded one and back, and its losses after the resume and every layer's
parameters equal an uninterrupted pp=2 run within 1e-5 (data position included: the resumed iterations read the
batches the uninterrupted run read)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, run_command, uninterrupted_run, worst_difference

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MODEL = ["--hidden", "16", "--layers", "4", "--seq", "8", "--micro-batch-size", "2", "--device", "cpu",
         "--timeout-s", "60"]
GRIDS = {"pp2": (2, ["-m", "2"]), "pp1": (1, ["-m", "2"]), "dp2": (2, ["--dp", "2", "-m", "1"]),
         "dp2-sharded": (2, ["--dp", "2", "-m", "1", "--shard-optimizer"])}


def _run(grid: str, args: list[str], cwd: Path, name: str) -> tuple[str, dict]:
    nproc, flags = GRIDS[grid]
    launcher = forkrun_cmd(nproc) if nproc > 1 else [sys.executable]
    p = run_command([*launcher, PIPELINE, *MODEL, *flags, *args, "--json", f"{name}.json"], cwd, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, json.loads((cwd / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return uninterrupted_run(tmp_path_factory.mktemp("reference"), [*MODEL, "-m", "2", "--iters", "4"])


@pytest.mark.parametrize("saved, resumed", [("pp2", "pp1"), ("pp1", "pp2"), ("dp2", "pp1"), ("dp2-sharded", "pp1"),
                                           ("pp1", "dp2-sharded")])
def test_resume_on_another_grid_equals_the_uninterrupted_run(tmp_path, reference, saved, resumed):
    _run(saved, ["--iters", "2", "--save", "ck"], tmp_path, "first")
    out, got = _run(resumed, ["--iters", "4", "--resume", "ck", "--save", "ck"], tmp_path, "second")
    assert "peerline: resumed from ck at iteration 2" in out
    assert "notice: the data differs" not in out
    assert got["iterations"] == [3, 4]
    tail = {"losses": reference["losses"][2:], "layer_checksums": reference["layer_checksums"]}
    worst, where = worst_difference(got, tail)
    assert worst <= 1e-5, (worst, where)
    assert {k.split("/")[1] for k in got["layer_checksums"]} == {k.split("/")[1] for k in tail["layer_checksums"]}
    manifest = json.loads((tmp_path / "ck" / "iter_000004" / "manifest.json").read_text())
    assert manifest["grid"]["pp"] == (2 if resumed == "pp2" else 1) and manifest["iteration"] == 4


def test_another_model_shape_is_refused_in_one_line(tmp_path):
    _run("pp2", ["--iters", "1", "--save", "ck"], tmp_path, "first")
    p = run_command([sys.executable, PIPELINE, *MODEL, "--layers", "6", "--iters", "2", "--resume", "ck"], tmp_path,
                    cpu_env(), timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("peerline: error:")]
    assert p.returncode == 2 and errors == [
        "peerline: error: checkpoint ck/iter_000001 does not match this run: model.layers is 4 in the checkpoint, 6 "
        "in this run"], p.stderr
