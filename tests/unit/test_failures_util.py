"""tests/multiproc/failures_util.py's hang report: a rank still running when the limit passes is sent SIGABRT
first, so faulthandler (on through PYTHONFAULTHANDLER, which spawn sets) writes every thread's Python stack into
the report, then it is killed; a rank that already ended keeps its own output. Real processes and forked ranks
alike."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkjob
from tests.multiproc.failures_util import Hang, Rank, _tails, spawn


def test_a_hung_rank_reports_every_threads_stack() -> None:
    code = ("import threading, time\n"
            "def waiting_on_a_peer():\n    time.sleep(60)\n"
            "threading.Thread(target=waiting_on_a_peer, daemon=True).start()\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")
    hung = subprocess.Popen([sys.executable, "-c", code], env={"PYTHONFAULTHANDLER": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert hung.stdout.readline().strip() == "started"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    done = Rank(1, "", "peerline: error: rank 0 ran out of GPU memory\n", 1.0)
    report = _tails([ended, hung], [done])
    assert "--- rank 0 (exit 1), last output:\npeerline: error: rank 0 ran out of GPU memory" in report
    assert "--- rank 1 (exit -6)" in report, report
    assert "waiting_on_a_peer" in report and "most recent call first" in report, report
    assert hung.poll() is not None


def test_a_forked_hung_job_reports_every_ranks_stack(tmp_path) -> None:
    """The same report from forked ranks (tests/forkjob.py's run_ranks): past the limit every rank still running is
    sent SIGABRT and its stacks are in the report; nothing of the job is left running."""
    if not forkjob.enabled():
        pytest.skip("PEERLINE_TEST_FORKSERVER=0: spawn starts real processes")
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PEERLINE_FAULT="hang:rank=1:iter=1")
    with pytest.raises(Hang) as hang:
        spawn(2, ["--hidden", "32", "--layers", "4", "--seq", "8", "--iters", "3", "--timeout-s", "600"], tmp_path,
              env, limit_s=15)
    report = str(hang.value)
    assert report.startswith("ranks still running after 15 s: "), report
    for rank in (0, 1):
        part = report.split(f"--- rank {rank} (exit -6), last output:\n")[1].split("--- rank ")[0]
        assert "most recent call first" in part, report
    server = forkjob.ForkServer.shared().proc.pid
    t0 = time.monotonic()
    while _children(server) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not _children(server), "the job is still running"


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found
