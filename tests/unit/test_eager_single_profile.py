"""tools/gpu_probes/eager_single_profile.py runs on the CPU (its GPU rows need a GPU): both sides' wall and host rows
are printed with positive figures, the side-by-side line parses, and --trace-dir keeps each side's trace."""

import gzip
import json
import os
import re
import subprocess
import sys

from tests.helpers import REPO


def test_the_probe_prints_both_sides_and_keeps_their_traces(tmp_path) -> None:
    probes = REPO / "tools" / "gpu_probes"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{probes}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(probes / "eager_single_profile.py"), "--device", "cpu",
                           "--config", "quick", "--iters", "1", "--timed", "2", "--top", "5",
                           "--trace-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    walls = dict(re.findall(r"INFO (torch|peerline): wall (\S+) ms/iter", out))
    assert set(walls) == {"torch", "peerline"} and all(float(v) > 0 for v in walls.values()), out
    side = re.search(r"side by side \(torch / peerline\): wall (\S+) / (\S+) ms \(ratio (\S+)\)", out)
    assert side and float(side[3]) > 0, out
    assert re.search(r"INFO peerline host +\S+ ms +x +\d+ +\S", out), out
    for name in ("torch", "peerline"):
        with gzip.open(tmp_path / f"{name}.json.gz", "rt") as f:
            assert json.load(f)["traceEvents"], name
