"""tests/multiproc/failures_util.py's hang report: a rank still running when the limit passes is sent SIGABRT
first, so faulthandler (on through PYTHONFAULTHANDLER, which spawn sets) writes every thread's Python stack into
the report, then it is killed; a rank that already ended keeps its own output."""

import subprocess
import sys

from tests.multiproc.failures_util import Rank, _tails


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
