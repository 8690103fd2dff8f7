"""Checkpoints say what they did, once per job, on 2 ranks (pp=2, gloo): a line per save, one at resume, and a run
resumed at --iters says there is nothing to do and exits 0 without a final loss; the --json record of the pp=2 run
holds the resolved pp, dtype and graph, the final loss, the version and the commit."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cpu_env
from tests.multiproc.failures_util import spawn

pytestmark = pytest.mark.timeout(240)

MODEL = ["--hidden", "16", "--layers", "2", "--seq", "8", "--micro-batch-size", "2", "-m", "2", "--device", "cpu"]


def test_saves_and_resumes_say_so_once_and_a_finished_run_has_nothing_to_do(tmp_path):
    first = spawn(2, [*MODEL, "--iters", "2", "--save", "ck", "--save-every", "1", "--json", "r.json"], tmp_path,
                  cpu_env())
    assert all(r.rc == 0 for r in first), first[0].err + first[1].err
    saved = [ln for ln in first[0].out.splitlines() if "saved checkpoint" in ln]
    assert saved == [f"peerline: saved checkpoint of iteration {n} to ck" for n in (1, 2)]
    lines = [ln for ln in first[0].out.splitlines() if ln.startswith(("iter ", "peerline: saved"))]
    assert [ln.split(" |")[0] for ln in lines] == ["iter 1/2", saved[0], "iter 2/2", saved[1]], lines  # in order
    assert "saved checkpoint" not in first[1].out  # rank 0 only
    rec = json.loads((tmp_path / "r.json").read_text())
    assert (rec["config"]["pp"], rec["config"]["dtype"], rec["config"]["graph"]) == (2, "fp32", False)
    assert rec["final_loss"] == rec["losses"][-1] and rec["peerline_version"] and "git_commit" in rec

    again = spawn(2, [*MODEL, "--iters", "2", "--resume", "ck", "--json", "again.json"], tmp_path, cpu_env())
    assert all(r.rc == 0 for r in again), again[0].err + again[1].err
    out = again[0].out
    assert "peerline: resumed from ck at iteration 2" in out
    assert "peerline: nothing to do: the checkpoint in ck is at iteration 2 >= --iters 2" in out
    assert "final loss" not in out and "nan" not in out
    assert again[1].out == ""
    assert json.loads((tmp_path / "again.json").read_text())["final_loss"] is None
