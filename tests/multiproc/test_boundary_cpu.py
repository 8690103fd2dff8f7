"""Stage boundaries of several tensors on the CPU (gloo): a user model whose layers hand each other tuples and dicts
of float, bf16 and int64 tensors (models/tuple_model.py), split at pp=2 and pp=4 (ranks forked with torchrun's
variables: tests/forkjob.py) and as stages of one process, against the single-process run of the same model and seed.

fp32 on the CPU: a split reorders no arithmetic inside a layer and packing moves bytes unchanged, so losses and
every layer's parameters match to 1e-6 relative (in practice bitwise).
"""

import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, assert_same_run, cpu_env, forkrun_cmd, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MODELS = str(Path(__file__).resolve().parent / "models")
ARGS = ["--hidden", "32", "--seq", "8", "--micro-batch-size", "2", "--iters", "3", "-m", "4",
        "--model", "tuple_model:build"]


def env():
    return cpu_env(PYTHONPATH=MODELS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc, res = run_job([sys.executable], ARGS, tmp, "ref", env=env())
    assert proc.returncode == 0, proc.stderr
    assert "layers 0-7" in proc.stdout  # one stage holds every layer
    return res


@pytest.mark.parametrize("pp,schedule", [(2, "gpipe"), (2, "1f1b"), (4, "1f1b")])
def test_pipeline_of_structures_equals_single_process(tmp_path, reference, pp, schedule):
    proc, res = run_job(forkrun_cmd(pp), [*ARGS, "--pp", str(pp), "--schedule", schedule], tmp_path, "pp",
                        env=env())
    assert proc.returncode == 0, proc.stderr
    assert res["world_size"] == pp and res["transport"] == "gloo"
    # The cuts the model's docstring describes: each kind of structure crosses a rank boundary.
    cuts = {2: "stage 0: layers 0-3; stage 1: layers 4-7",
            4: "stage 0: layers 0-1; stage 1: layers 2-3; stage 2: layers 4-5; stage 3: layers 6-7"}
    assert cuts[pp] in proc.stdout
    assert_same_run(res, reference, rtol=1e-6)


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_of_one_process_pass_structures_by_reference(tmp_path, reference, stages):
    proc, res = run_job([sys.executable], [*ARGS, "--stages", str(stages)], tmp_path, f"stages{stages}", env=env())
    assert proc.returncode == 0, proc.stderr
    assert_same_run(res, reference, rtol=1e-6)


def test_a_boundary_no_transport_can_carry_is_one_line(tmp_path):
    args = [*ARGS[:-1], "tuple_model:bad_boundary", "--pp", "2"]
    proc, _ = run_job(forkrun_cmd(2), args, tmp_path, "bad", timeout=120, env=env())
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("peerline: error:")]
    assert 1 <= len(lines) <= 2, proc.stderr  # stage 0's rank, and stage 1's that it handed the line to
    assert all("stage 0's output gives int at [1]" in ln for ln in lines), lines
    assert f'File "{REPO}' not in proc.stderr, proc.stderr
