"""--precision bf16 on the CPU (gloo): bf16 weights, gradients and AdamW state, the model in bf16 throughout. A
pipeline of it (1F1B and the zero-bubble split, forked ranks) against one process of the same recipe, model and seed:
each stage runs the same bf16 ops on the same shapes, so the runs agree to bf16 rounding of nothing (1e-6 allows
the checksums' own float64 sums). The synthetic float input of the residual-MLP model is cast to bf16 on entry."""

import sys

import pytest

from tests.helpers import TINY, assert_same_run, forkrun_cmd, run_job

pytestmark = pytest.mark.timeout(300)

GPT = ["--model", "gpt", "--heads", "4", *TINY]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    refs = {}
    for name, model in (("gpt", GPT), ("mlp", TINY)):
        proc, res = run_job([sys.executable], [*model, "-m", "4", "--precision", "bf16"], tmp, f"ref_{name}")
        assert proc.returncode == 0, proc.stderr
        refs[name] = res
    return refs


@pytest.mark.parametrize("model", ["gpt", "mlp"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_precision_pp2_equals_single_process(tmp_path, reference, model, schedule):
    args = GPT if model == "gpt" else TINY
    proc, res = run_job(forkrun_cmd(2), [*args, "-m", "4", "--pp", "2", "--schedule", schedule, "--precision", "bf16"],
                        tmp_path, "pp2")
    assert proc.returncode == 0, proc.stderr
    assert res["world_size"] == 2
    assert_same_run(res, reference[model], rtol=1e-6)


def test_bf16_precision_differs_from_master_only_by_rounding(tmp_path, reference):
    proc, res = run_job([sys.executable], [*GPT, "-m", "4"], tmp_path, "master")
    assert proc.returncode == 0, proc.stderr
    bf16, master = reference["gpt"]["losses"], res["losses"]
    assert bf16 != master, "the recipes must differ (bf16 weights round)"
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(bf16, master)), (bf16, master)
