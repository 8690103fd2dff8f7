"""slurm/multinode.sbatch across a simulated three-node Slurm (tests/slurm/multinode_cluster.py: one network
namespace, address, host name and slurmd per node), in its CPU form: one torchrun agent per node, c10d rendezvous
at the head node's namespace address, gloo pinned to each node's interface (PEERLINE_IFNAME=eth0).

  pp=2 x dp=2 on 2 nodes x 2 ranks: each replica's pipeline inside a node, the gradient all-reduce across nodes
  pp=4 on 2 nodes x 2 ranks: the stage 1 -> 2 boundary crosses from node1 to node2

Both equal the single-process run with the same 4 microbatches per iteration: losses and every layer's parameters
(1e-5 relative). The start-up line must name each edge's transport and hosts.

Skips, with the reason, where network namespaces cannot be made (not root, a sandbox that refuses them), even
under PEERLINE_REQUIRE_SLURM=1: the single-node tests (test_sbatch.py) still cover the scripts there; a missing
Slurm fails under PEERLINE_REQUIRE_SLURM=1 as in those tests.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode_cluster import MultiNodeCluster, netns_unavailable_reason
from slurm_cluster import JobResult, SlurmUnavailable, ensure_installed, skip_or_fail

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import assert_same_run  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(os.environ.get("PEERLINE_REPO") or Path(__file__).resolve().parents[2]).resolve()
SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "multinode.sbatch"
MODEL = ["--seq", "16", "--hidden", "32", "--layers", "8", "--micro-batch-size", "2", "--iters", "3", "--seed", "11",
         "--dtype", "fp32", "--schedule", "1f1b"]
TOTAL_MICROBATCHES = 4
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPUS", "TASKS",
          "PEERLINE_RESOLVE_ONLY", "PEERLINE_HEAD_ADDR", "PEERLINE_DEVICE", "PEERLINE_PYTHON", "OMP_NUM_THREADS",
          "PEERLINE_HOST_ID", "PEERLINE_IFNAME", "PEERLINE_FAULT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    """Three nodes, each in its own network namespace; removed (daemons, namespaces, links) at the end."""
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no simulated nodes here: {reason}")
    try:
        ensure_installed(timeout_s=240)
    except SlurmUnavailable as exc:
        skip_or_fail(str(exc))
    c = MultiNodeCluster(tmp_path_factory.mktemp("slurm-multi"), nodes=3)
    atexit.register(c.stop)
    try:
        try:
            c.start()
        except (SlurmUnavailable, RuntimeError) as exc:
            pytest.fail(f"the simulated cluster did not start: {exc}", pytrace=False)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The single-process run (--pp 1 --dp 1, all 4 microbatches)."""
    import json

    out = tmp_path_factory.mktemp("multi-ref") / "ref.json"
    cmd = [sys.executable, str(REPO / "launch" / "pipeline.py"), "--device", "cpu", "-m", str(TOTAL_MICROBATCHES),
           *MODEL, "--json", str(out)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"reference run failed: {proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def submit(cluster: MultiNodeCluster, args: list[str], tmp_path: Path, nodes: int = 2, timeout_s: float = 150,
           **env: str) -> JobResult:
    """multinode.sbatch in its CPU form on `nodes` nodes, one agent of 2 ranks each, gloo on each node's eth0."""
    job_env = clean_env(PEERLINE_DEVICE="cpu", PEERLINE_PYTHON=sys.executable, PEERLINE_IFNAME="eth0", **env)
    return cluster.sbatch(SCRIPT, args, options=["--time=4", f"--nodes={nodes}", "--ntasks-per-node=1",
                                                 "--gpus-per-node=0", f"--cpus-per-task={2}"],
                          env=job_env, cwd=REPO, log_dir=tmp_path, timeout_s=timeout_s)


def edges_line(result: JobResult) -> str:
    found = [line for line in result.log.splitlines() if line.startswith("peerline: p2p edges ")]
    assert len(found) == 1, result.describe()
    return found[0]


GRIDS = {
    # each replica's pipeline on one node; only the dp all-reduce crosses nodes
    "pp2_dp2": (["--pp", "2", "--dp", "2", "-m", "2"],
                "p2p edges over 2 host(s), 0 across hosts: 0-1 gloo (node1), 2-3 gloo (node2)"),
    # the pipeline's middle boundary crosses from node1 to node2
    "pp4": (["--pp", "4", "--dp", "1", "-m", "4"],
            "p2p edges over 2 host(s), 1 across hosts: 0-1 gloo (node1), 1-2 gloo (node1 -> node2), "
            "2-3 gloo (node2)"),
}


@pytest.mark.parametrize("grid", list(GRIDS))
def test_two_nodes_equal_single_process(grid: str, cluster: MultiNodeCluster, reference: dict,
                                        tmp_path: Path) -> None:
    import json

    flags, want_edges = GRIDS[grid]
    out = tmp_path / "job.json"
    result = submit(cluster, [*flags, *MODEL, "--json", str(out)], tmp_path)
    assert result.returncode == 0, result.describe()
    head = re.search(r"nodes=2 \((\S+)\) ranks_per_node=2 world=4 .* head=(\S+) addr=(\S+):(\d+)$",
                     next(line for line in result.log.splitlines() if line.startswith("peerline-slurm: job=")))
    assert head, result.describe()
    assert head.groups()[:3] == ("node[1-2]", "node1", cluster.addrs["node1"]), head.group(0)
    assert "peerline-slurm: job=" in result.log and out.exists(), result.describe()
    res = json.loads(out.read_text())
    assert res["world_size"] == 4 and res["launcher"] == "torchrun"
    assert_same_run(res, reference)
    assert edges_line(result) == f"peerline: {want_edges}"


#: seconds past --timeout-s within which node1's ranks exit after node2 is cut off (measured on a loaded 2-core
#: machine: 3-5 s). node2's isolated ranks are given as long, then node2 comes back (before torchrun's 60 s store
#: timeout): their exit may wait on the unreachable rendezvous store (measured 4 s to over 75 s).
GRACE_S = 20


def _rank_processes(cluster: MultiNodeCluster, nodes: list[str]) -> list[int]:
    """PIDs of training ranks (not the torchrun agents) in the nodes' namespaces."""
    found = []
    for node in nodes:
        for pid in cluster.node_pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"torch.distributed.run" not in cmd and any(c.endswith(b"launch/pipeline.py") for c in cmd):
                found.append(pid)
    return found


def test_lost_node_ends_every_rank_then_the_job_resumes(cluster: MultiNodeCluster, tmp_path: Path) -> None:
    """pp=4 over node1 and node2 with PEERLINE_MAX_RESTARTS=1 and --save/--resume of one shared folder. Once the
    first checkpoint exists, node2's link is cut; node2 comes back at the latest --timeout-s + GRACE_S later;
    every rank of the first attempt ends, and where node1's ranks name who stopped, they name node2's ranks on
    node2. Once the link is back, the agents meet again, the ranks restart, resume from the checkpoint and finish
    with the losses and parameters of an uninterrupted single-process run."""
    import json
    import threading
    import time

    from tests.helpers import worst_difference

    iters, deadline_s = 100, 10
    model = [*MODEL, "--iters", str(iters), "--log-every", "10"]
    ck, out = tmp_path / "ck", tmp_path / "job.json"
    ref_out = tmp_path / "ref.json"
    ref = subprocess.Popen([sys.executable, str(REPO / "launch" / "pipeline.py"), "--device", "cpu", "-m", "4",
                            *model, "--json", str(ref_out)], env=clean_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    job: dict[str, JobResult] = {}
    args = ["--pp", "4", "-m", "4", *model, "--timeout-s", str(deadline_s), "--save", str(ck), "--save-every", "10",
            "--resume", str(ck), "--json", str(out)]
    submitter = threading.Thread(target=lambda: job.setdefault("r", submit(cluster, args, tmp_path, timeout_s=240,
                                                                           PEERLINE_MAX_RESTARTS="1")))
    submitter.start()
    try:
        t0 = time.monotonic()
        while not (ck / "latest").exists() and submitter.is_alive() and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        assert (ck / "latest").exists(), "no checkpoint before the job ended"
        before = set(_rank_processes(cluster, ["node1", "node2"]))
        cluster.set_link("node2", up=False)
        cut = time.monotonic()
        while _rank_processes(cluster, ["node1"]) and time.monotonic() - cut < deadline_s + GRACE_S:
            time.sleep(0.5)
        node1_s = time.monotonic() - cut
        node1_left = bool(_rank_processes(cluster, ["node1"]))
        # The node comes back before torchrun's store operations time out (60 s) on node2's agent.
        while before & set(_rank_processes(cluster, ["node2"])) and time.monotonic() - cut < deadline_s + GRACE_S:
            time.sleep(0.5)
        node2_s = time.monotonic() - cut
        node2_isolated_left = before & set(_rank_processes(cluster, ["node2"]))
    finally:
        cluster.set_link("node2", up=True)
    t_up = time.monotonic()
    while before & set(_rank_processes(cluster, ["node1", "node2"])) and time.monotonic() - t_up < 60:
        time.sleep(0.5)
    old_left = before & set(_rank_processes(cluster, ["node1", "node2"]))
    submitter.join(timeout=300)
    result = job["r"]
    state = {True: "still running", False: "ended"}
    print(f"node1's ranks {state[node1_left]} at {node1_s:.1f} s after node2 was cut off, node2's "
          f"{state[bool(node2_isolated_left)]} at {node2_s:.1f} s (--timeout-s {deadline_s})")
    # Every rank of the first attempt ends (node1's usually within the deadline + a few seconds; see GRACE_S).
    assert not old_left, f"ranks of the first attempt still running after node2 came back\n{result.describe()}"
    errors = [line for line in result.log.splitlines() if line.startswith("peerline: error: ")]
    assert errors, f"no rank said why it stopped\n{result.describe()}"
    # Where node1's ranks name who stopped, they name node2's ranks and node2.
    named = [line for line in errors if line.startswith(("peerline: error: rank 0 ", "peerline: error: rank 1 "))
             and "stopped responding" in line]
    assert all("rank 2 (stage 2, on node2)" in line and "rank 3 (stage 3, on node2)" in line for line in named), named
    assert result.returncode == 0, result.describe()
    assert ref.wait(timeout=120) == 0, ref.stderr.read()
    got, want = json.loads(out.read_text()), json.loads(ref_out.read_text())
    resumed_at = got["iterations"][0]
    assert 10 < resumed_at < iters and got["iterations"][-1] == iters, got["iterations"]
    tail = dict(want, losses=want["losses"][want["iterations"].index(resumed_at):])
    worst, where = worst_difference(got, tail)
    assert worst <= 1e-5, (worst, where)
