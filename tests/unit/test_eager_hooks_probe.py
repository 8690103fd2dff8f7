"""tools/gpu_probes/eager_hooks_probe.py runs on the CPU (its figures need a GPU): the three sides are printed with
positive times, torch's ratio to itself is 1, and the others' ratios are its time over theirs."""

import os
import re
import subprocess
import sys

from tests.helpers import REPO


def test_the_probe_prints_three_sides_with_their_ratios() -> None:
    probes = REPO / "tools" / "gpu_probes"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{probes}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(probes / "eager_hooks_probe.py"), "--device", "cpu",
                           "--config", "quick", "--timed", "2", "--reps", "2"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"INFO (torch|peerline|peerline, no failsafe) +(\S+) ms/iter +torch / side (\S+)", proc.stdout)
    assert [r[0] for r in rows] == ["torch", "peerline", "peerline, no failsafe"], proc.stdout
    times = {name: float(ms) for name, ms, _ in rows}
    assert all(t > 0 for t in times.values()), proc.stdout
    for name, _, ratio in rows:
        assert abs(float(ratio) - times["torch"] / times[name]) < 5e-3, (name, ratio, times)  # both printed rounded
