"""The pieces of launch/bench.py --isolate that need no torch job (bench/isolation.py, isolation_child.py,
proc_tree.py): a job's process tree ended whole, even a rank in a session of its own that ignores SIGTERM; a job
past its limit noted as not finished with its rank's line; a job's error line found; the ranks of the jobs; the
results of a measurement carried from one job to the next."""

import json
import signal
import sys
import time
from argparse import Namespace

import pytest

from peerline.bench import isolation, proc_tree
from peerline.bench.benchkit import Timing
from peerline.bench.ideal import IdealReport
from peerline.bench.isolation_child import measured_from_dict, measured_to_dict
from peerline.bench.runtime_timing import Measured

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

# A job like torchrun's: it starts a "rank" in a session of its own that ignores SIGTERM, says which measurement
# it took, prints a rank's error line, and never ends.
FAKE_JOB = """
import json, os, signal, subprocess, sys, time
folder = sys.argv[1]
rank = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "print('rank up', flush=True); time.sleep(600)"], start_new_session=True)
with open(os.path.join(folder, "rank.pid"), "w") as f:
    f.write(str(rank.pid))
with open(os.path.join(folder, "started.json"), "w") as f:
    json.dump({"id": "pipeline quick 1f1b eager"}, f)
print("peerline: error: rank 0 (stage 0) stopped in iteration 3", flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def fake_jobs(monkeypatch, tmp_path):
    script = tmp_path / "fake_job.py"
    script.write_text(FAKE_JOB)
    monkeypatch.setattr(isolation, "job_command", lambda nproc, argv, out, folder: [sys.executable, str(script),
                                                                                      str(folder)])
    return tmp_path


def test_a_job_past_its_limit_is_ended_whole_and_noted(fake_jobs):
    said: list[str] = []
    runner = isolation.Runner(2, [], fake_jobs, limit_s=3.0, say=said.append, subreaper=False)
    folder = fake_jobs / "job"
    folder.mkdir()
    job = runner.run(folder, lambda mid: f"pipeline 1/1: {mid}")
    assert job.timed_out and job.status == "failed" and job.started == "pipeline quick 1f1b eager"
    assert job.error == ("did not finish within 3 s (its processes were ended); "
                         "rank 0 (stage 0) stopped in iteration 3"), job.error
    rank = int((folder / "rank.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank), "the rank in its own session, ignoring SIGTERM, was left running"
    assert any("pipeline 1/1: pipeline quick 1f1b eager: running" in s for s in said), said
    assert any("ended after 3 s" in s for s in said), said


def test_end_tree_reaches_every_session(tmp_path):
    import subprocess

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
            "start_new_session=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not proc_tree.descendants(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = proc_tree.descendants(proc.pid)
    assert proc_tree.end_tree(proc, grace_s=2.0) == 2
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_the_error_of_a_job_is_its_first_error_line(tmp_path):
    (tmp_path / "log.txt").write_text("starting\n[rank1]: peerline: error: rank 1: pipeline quick gpipe eager failed: "
                                      "RuntimeError: boom\nTraceback ...\n  traceback : peerline: error: later\n")
    assert isolation._error_of(tmp_path, 1, False, 60, None) == (
        "rank 1: pipeline quick gpipe eager failed: RuntimeError: boom")
    assert isolation._error_of(tmp_path, 0, False, 60, {"outcome": "ok: 3 records"}) == ""
    (tmp_path / "log.txt").write_text("Killed\n")
    assert isolation._error_of(tmp_path, -9, False, 60, None) == "exit -9 without an error line; its last line: Killed"


def test_job_ranks(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert isolation.job_ranks(Namespace(ranks=None)) == 1
    assert isolation.job_ranks(Namespace(ranks=4)) == 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert isolation.job_ranks(Namespace(ranks=None)) == 2
    with pytest.raises(ValueError, match="--ranks 4 differs from torchrun's 2 ranks"):
        isolation.job_ranks(Namespace(ranks=4))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="this launch spans 2 hosts"):
        isolation.job_ranks(Namespace(ranks=None))


def test_jobs_get_no_launcher_variables(monkeypatch):
    for k, v in {"RANK": "0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "PEERLINE_DEVICE": "cpu"}.items():
        monkeypatch.setenv(k, v)
    env = isolation.job_environment()
    assert env["PEERLINE_DEVICE"] == "cpu" and not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    cmd = isolation.job_command(2, ["pipeline", "--isolate"], isolation.Path("/o"), isolation.Path("/o/j"))
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[-6:] == ["pipeline", "--isolate", "--out", "/o", "--isolated-child", "/o/j"]


def test_a_measured_result_survives_the_ledger():
    m = Measured("eager", Timing(2.0, 1.5, 3.0, 5), [1.25, 1.0], IdealReport("1f1b", 4, (0.1, 0.2), (0.3, 0.4), 2.0),
                 0.0, {"transport": "gloo", "candidates": {"1f1b fp32": {"ms_per_iter": 2.0}}}, [])
    back = measured_from_dict(json.loads(json.dumps(measured_to_dict(m))))
    assert back == m and back.ideal.bound_ms == m.ideal.bound_ms


def test_an_interrupted_bench_ends_the_job_running(fake_jobs):
    """A signal that ends the bench (here SIGALRM, raised as an exception like run_isolated's SIGTERM handler) ends
    the job running with every process it started."""

    def interrupt(signum, frame):
        raise isolation.Interrupted("SIGALRM")

    runner = isolation.Runner(2, [], fake_jobs, limit_s=120.0, say=lambda line: None, subreaper=False)
    folder = fake_jobs / "job"
    folder.mkdir()
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.alarm(3)
        with pytest.raises(isolation.Interrupted):
            runner.run(folder, lambda mid: str(mid))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    rank = int((folder / "rank.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(rank)
