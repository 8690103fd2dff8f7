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
import math
import os
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from multinode_cluster import MultiNodeCluster, netns_unavailable_reason
from slurm_cluster import JobResult, SlurmUnavailable, ensure_installed, skip_or_fail

from peerline.distributed.resilience.watchdog import EXIT_MARGIN_S

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import timeouts  # noqa: E402
from tests.helpers import assert_same_run, run_command  # noqa: E402

# Under `pytest -n 2 --dist loadgroup` (.ci/run) one worker runs these while the other runs the single-node tests.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300), pytest.mark.xdist_group("multinode")]

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
    """The single-process run (--pp 1 --dp 1, all 4 microbatches), forked from the test fork server
    (tests/forkjob.py): the reference is not what these tests are about."""
    import json

    out = tmp_path_factory.mktemp("multi-ref") / "ref.json"
    cmd = [sys.executable, str(REPO / "launch" / "pipeline.py"), "--device", "cpu", "-m", str(TOTAL_MICROBATCHES),
           *MODEL, "--json", str(out)]
    proc = run_command(cmd, out.parent, clean_env(), timeout=180)
    assert proc.returncode == 0, f"reference run failed: {proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def submit(cluster: MultiNodeCluster, args: list[str], tmp_path: Path, nodes: int = 2, timeout_s: float = 150,
           time_min: int = 4, **env: str) -> JobResult:
    """multinode.sbatch in its CPU form on `nodes` nodes, one agent of 2 ranks each, gloo on each node's eth0;
    `time_min` is the job's Slurm time limit, `timeout_s` how long the job may take from its submission."""
    job_env = clean_env(PEERLINE_DEVICE="cpu", PEERLINE_PYTHON=sys.executable, PEERLINE_IFNAME="eth0", **env)
    return cluster.sbatch(SCRIPT, args, options=[f"--time={time_min}", f"--nodes={nodes}", "--ntasks-per-node=1",
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


#: seconds past --timeout-s within which every rank of the first attempt exits once node2 is cut off: the watchdog
#: notices the deadline within a poll, and its report is bounded (EXIT_MARGIN_S) whatever the unreachable store does;
#: plus LOADED_S times the load factor (tests/timeouts.py) for the processes' own ends on a loaded 2-core machine.
MARGIN_S = 1.0 + EXIT_MARGIN_S
LOADED_S = 3.0
#: The whole job on a quiet machine takes about 45 s (two attempts' start-up, 100 iterations, the cut); its Slurm
#: limit is this many minutes times the load factor, and the wait for it gets 30 s more, so a slow job ends by
#: Slurm's limit with its log, not by the wait's.
JOB_MIN = 4


def _rank_processes(cluster: MultiNodeCluster, nodes: list[str]) -> list[int]:
    """PIDs of training ranks in the nodes' namespaces: `python [-u] .../launch/pipeline.py ...`, not the torchrun
    agents, srun or the batch shell, whose command lines name the entry too."""
    found = []
    for node in nodes:
        for pid in cluster.node_pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [c for c in cmd[1:] if c and not c.startswith(b"-")]
            if Path(cmd[0].decode(errors="replace")).name.startswith("python") and args and args[0].endswith(
                    b"launch/pipeline.py"):
                found.append(pid)
    return found


def _exit_times(cluster: MultiNodeCluster, pids: dict[int, str], since: float, limit_s: float) -> dict[int, float]:
    """Seconds after `since` at which each of `pids` (pid -> node) ended, polling for up to `limit_s`."""
    import time

    ended: dict[int, float] = {}
    while len(ended) < len(pids) and time.monotonic() - since < limit_s:
        running = set(_rank_processes(cluster, sorted(set(pids.values()))))
        now = time.monotonic() - since
        ended.update({p: now for p in pids if p not in running and p not in ended})
        time.sleep(0.2)
    return ended


def test_lost_node_ends_every_rank_then_the_job_resumes(cluster: MultiNodeCluster, tmp_path: Path) -> None:
    """pp=4 over node1 and node2 with PEERLINE_MAX_RESTARTS=1 and --save/--resume of one shared folder. Once the
    first checkpoint exists, node2's link is cut; every rank of the first attempt, on both nodes, ends within
    --timeout-s + MARGIN_S (+ LOADED_S per unit of load) of the cut (node2's cannot reach the rendezvous store,
    hosted by rank 0 on node1), and node1's ranks name node2 and its ranks. Once the link is back, the agents meet
    again, the ranks restart, resume from the checkpoint and finish with the losses and parameters of an
    uninterrupted single-process run. Its limits grow with the load when it starts (tests/timeouts.py)."""
    import json
    import threading
    import time

    from tests.helpers import worst_difference

    iters, deadline_s = 100, 10
    load = timeouts.scale()  # the machine's load per core now, at least 1: every limit below grows with it
    margin_s = MARGIN_S + LOADED_S * load
    job_min = math.ceil(JOB_MIN * load)
    wait_s = job_min * 60 + 30
    model = [*MODEL, "--iters", str(iters), "--log-every", "10"]
    ck, out = tmp_path / "ck", tmp_path / "job.json"
    ref_out = tmp_path / "ref.json"
    # The uninterrupted single-process run, forked from the test fork server beside the job.
    refs = ThreadPoolExecutor(1)
    ref = refs.submit(run_command, [sys.executable, str(REPO / "launch" / "pipeline.py"), "--device", "cpu", "-m",
                                    "4", *model, "--json", str(ref_out)], tmp_path, clean_env(),
                      wait_s + 120 * load)
    refs.shutdown(wait=False)
    job: dict[str, JobResult] = {}
    args = ["--pp", "4", "-m", "4", *model, "--timeout-s", str(deadline_s), "--save", str(ck), "--save-every", "10",
            "--resume", str(ck), "--json", str(out)]
    submitter = threading.Thread(target=lambda: job.setdefault("r", submit(
        cluster, args, tmp_path, timeout_s=wait_s, time_min=job_min, PEERLINE_MAX_RESTARTS="1")))
    t0 = time.monotonic()
    submitter.start()
    try:
        while not (ck / "latest").exists() and submitter.is_alive() and time.monotonic() - t0 < 120 * load:
            time.sleep(0.1)
        assert (ck / "latest").exists(), "no checkpoint before the job ended"
        before = {p: n for n in ("node1", "node2") for p in _rank_processes(cluster, [n])}
        assert len(before) == 4, before
        cut_at = time.monotonic()
        cluster.set_link("node2", up=False)
        ended = _exit_times(cluster, before, cut_at, deadline_s + margin_s + 5)
    finally:
        cluster.set_link("node2", up=True)
    submitter.join(timeout=wait_s + 30)
    assert "r" in job, f"the job still not waited for after {wait_s + 30:.0f} s"
    result = job["r"]
    late = {p: before[p] for p in before if ended.get(p, float("inf")) > deadline_s + margin_s}
    print(f"load factor {load:.2f}; first checkpoint {cut_at - t0:.1f} s after sbatch; ranks of the first attempt "
          "ended after the cut: "
          + ", ".join(f"{n} pid {p} at {ended.get(p, float('inf')):.1f} s" for p, n in sorted(before.items()))
          + f" (--timeout-s {deadline_s}, margin {margin_s:.1f} s); job done {time.monotonic() - t0:.1f} s after "
          f"sbatch (Slurm limit {job_min} min)")
    # Every rank of the first attempt ends within the deadline and the margin, on both sides of the cut.
    assert not late, f"ranks still running {deadline_s + margin_s:.1f} s after the cut: {late}\n{result.describe()}"
    errors = [line for line in result.log.splitlines() if line.startswith("peerline: error: ")]
    print("\n".join(errors))
    # node1's ranks (they reach the store, hosted by rank 0) name node2 and its ranks; at least one of them says
    # it (torchrun's agent may end the other with SIGTERM first, whose line names them too).
    node1 = [line for line in errors if line.startswith(("peerline: error: rank 0 ", "peerline: error: rank 1 "))]
    assert node1, f"no line from node1's ranks\n{result.describe()}"
    for line in node1:
        assert "node2 lost: rank 2 (stage 2, on node2)" in line and "rank 3 (stage 3, on node2)" in line, line
    # node2's ranks cannot reach the store: where their lines reached the log, they say so.
    for line in errors:
        if line.startswith(("peerline: error: rank 2 ", "peerline: error: rank 3 ")):
            assert "node2 lost" in line or "the rendezvous store at " in line, line
    assert result.returncode == 0, result.describe()
    ref_proc = ref.result()
    assert ref_proc.returncode == 0, ref_proc.stderr
    got, want = json.loads(out.read_text()), json.loads(ref_out.read_text())
    resumed_at = got["iterations"][0]
    assert 10 < resumed_at < iters and got["iterations"][-1] == iters, got["iterations"]
    tail = dict(want, losses=want["losses"][want["iterations"].index(resumed_at):])
    worst, where = worst_difference(got, tail)
    assert worst <= 1e-5, (worst, where)
