"""Per-edge transports on the CPU: two torchrun ranks told (PEERLINE_HOST_ID) that they run on different hosts.

The start-up line names the edge, its transport (gloo: on the CPU every edge is the collective one) and both
hosts; the run equals the single-process run (losses and every layer's parameters, 1e-5 relative) and the same
run with both ranks on one host. The choice between copy engine and NCCL is checked as data in
tests/unit/test_p2p_edges.py and on GPUs in tests/gpu/test_edges_gpu.py.
"""

import sys

import pytest

from tests.helpers import TINY, assert_same_run, cpu_env, forkrun_cmd, run_job

pytestmark = pytest.mark.timeout(300)


def _edges_line(stdout: str) -> str:
    found = [line for line in stdout.splitlines() if line.startswith("peerline: p2p edges ")]
    assert len(found) == 1, stdout
    return found[0]


def test_two_hosts_pick_the_collective_edge(tmp_path):
    proc, ref = run_job([sys.executable], [*TINY, "-m", "4"], tmp_path, "ref")
    assert proc.returncode == 0, proc.stderr
    runs = {}
    for hosts in ("hostA,hostB", "hostA,hostA"):
        proc, res = run_job(forkrun_cmd(2), [*TINY, "-m", "4", "--pp", "2"], tmp_path, hosts.replace(",", "_"),
                            env=cpu_env(PEERLINE_HOST_ID=hosts))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert res["transport"] == "gloo"
        assert_same_run(res, ref)
        runs[hosts] = (_edges_line(proc.stdout), res)
    assert runs["hostA,hostB"][0] == "peerline: p2p edges over 2 host(s), 1 across hosts: 0-1 gloo (hostA -> hostB)"
    assert runs["hostA,hostA"][0] == "peerline: p2p edges over 1 host(s), 0 across hosts: 0-1 gloo (hostA)"
    assert runs["hostA,hostB"][1]["losses"] == runs["hostA,hostA"][1]["losses"]
