"""Multi-process runs on the CPU (gloo) against a single-process run of the same model and seed.

fp32 on the CPU: per-iteration losses and every layer's parameters within 1e-5 relative (the pipeline reorders
no arithmetic inside a stage, but dp averaging sums gradients in a different order than one big batch).
"""

import re
import sys

import pytest

from tests.helpers import REPO, TINY, assert_same_run, forkrun_cmd, mpirun_cmd, run_job, torchrun_cmd

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    refs = {}
    for m in (4, 8):
        proc, res = run_job([sys.executable], [*TINY, "-m", str(m)], tmp, f"ref{m}")
        assert proc.returncode == 0, proc.stderr
        refs[m] = res
    return refs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pp2_equals_single_process(tmp_path, reference, schedule):
    # 1F1B under torchrun itself (the README's launch); the other schedules as forked ranks (start-up cost)
    launcher = torchrun_cmd(2) if schedule == "1f1b" else forkrun_cmd(2)
    proc, res = run_job(launcher, [*TINY, "-m", "4", "--pp", "2", "--schedule", schedule], tmp_path, "pp2")
    assert proc.returncode == 0, proc.stderr
    assert res["world_size"] == 2 and res["transport"] == "gloo"
    assert_same_run(res, reference[4])
    assert f"final loss={res['losses'][-1]:.9g}" in proc.stdout.strip().splitlines()[-1]


def test_dp2_equals_single_process_with_all_microbatches(tmp_path, reference):
    proc, res = run_job(forkrun_cmd(2), [*TINY, "-m", "4", "--pp", "1", "--dp", "2"], tmp_path, "dp2")
    assert proc.returncode == 0, proc.stderr
    assert_same_run(res, reference[8])
    assert {k.split("/")[0] for k in res["layer_checksums"]} == {"r0", "r1"}


def test_dp2_per_parameter_sync_equals_reference(tmp_path, reference):
    proc, res = run_job(forkrun_cmd(2), [*TINY, "-m", "4", "--dp", "2", "--grad-sync", "per-param"], tmp_path,
                        "dp2pp")
    assert proc.returncode == 0, proc.stderr
    assert_same_run(res, reference[8])


def test_mpirun_entry_point(tmp_path, reference):
    proc, res = run_job(mpirun_cmd(2), [*TINY, "-m", "4", "--schedule", "1f1b"], tmp_path, "mpi")
    assert proc.returncode == 0, proc.stderr
    assert res["launcher"] == "mpi"
    assert_same_run(res, reference[4])


def test_single_process_stages_as_streams_equal_one_stage(tmp_path, reference):
    proc, res = run_job([sys.executable], [*TINY, "-m", "4", "--stages", "2"], tmp_path, "stages2")
    assert proc.returncode == 0, proc.stderr
    assert_same_run(res, reference[4])


# Under torchrun: a grid check and a model factory's result; the rest as forked ranks (start-up cost): the
# reliability table (tests/reliability) runs more inputs under torchrun.
@pytest.mark.parametrize("launcher,args,message", [
    ("torchrun", ["--pp", "3"], "grid does not fit: pp=3 x dp=1 = 3 != world size 2"),
    ("forked", ["--schedule", "1f1b", "-m", "1"], "1f1b needs at least as many microbatches as stages"),
    ("forked", ["--global-batch", "7"], "not divisible"),
    ("torchrun", ["--model", "torch.nn:Identity"],
     "returned Identity; a factory returns an nn.Sequential, a list of nn.Modules"),
    ("forked", ["--model", "torch.nn:Linear"], "model factory 'torch.nn:Linear' raised TypeError"),
])
def test_bad_input_fails_on_every_rank_with_one_line(tmp_path, launcher, args, message):
    command = torchrun_cmd(2) if launcher == "torchrun" else forkrun_cmd(2)
    proc, _ = run_job(command, [*TINY, *args], tmp_path, "bad", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("peerline: error:")]
    # Each rank checks the same input; rank 0 reports it, under torchrun through its agent
    # (peerline/torchrun_report.py): the last line either way.
    assert len(lines) == 1 and proc.stderr.strip().splitlines()[-1] == lines[0], proc.stderr
    assert re.search(message, lines[0]), lines
    # No worker traceback (torchrun reports its failed children with a traceback of its own, in torch's files).
    assert f'File "{REPO}' not in proc.stderr, proc.stderr


def test_bad_flag_value_exits_2_single_process(tmp_path):
    proc, _ = run_job([sys.executable], [*TINY, "--microbatches", "0"], tmp_path, "bad1", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "peerline: error: --microbatches must be >= 1, got 0"
