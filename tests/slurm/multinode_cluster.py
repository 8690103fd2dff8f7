"""A throw-away Slurm of several nodes on one machine: each node a network namespace with its own address.

Layout (for nodes=3, subnet 10.77.S.0/24 with S picked per session so concurrent sessions do not meet):

    root namespace:  bridge plb<tag> 10.77.S.254   munged (a Unix socket: reachable from every namespace)
                                                   slurmctld (listens on every address, nodes reach .254)
    namespace pl<tag>n1:  veth 10.77.S.1, host name node1, its own /etc/hosts   slurmd -N node1
    namespace pl<tag>n2:  veth 10.77.S.2, host name node2                         slurmd -N node2
    namespace pl<tag>n3:  veth 10.77.S.3, host name node3                         slurmd -N node3

Each slurmd runs in its node's network, UTS and mount namespaces (`nsenter --net` + `unshare --uts --mount`), so
the jobs it starts see only their node's address, report their node's host name, and resolve every node's name
through a private /etc/hosts (bind-mounted inside the node's mount namespace; the machine's file is untouched).
Traffic between nodes crosses the bridge; the nodes have no route anywhere else. slurm.conf names every node with
NodeAddr (its namespace address) and NodeHostname; spool, pid and log files are per node (%n). Everything, the
namespaces and links included, is removed by `stop()` (by PID and by the names this object created), and by the
reaper shell if the test process dies first.

By hand:  python tests/slurm/multinode_cluster.py [ROOT] [NODES]   # prints SLURM_CONF, keeps it up until Ctrl-C
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_cluster import SlurmCluster, SlurmUnavailable, _sbin

log = logging.getLogger(__name__)

#: CPUs each simulated node declares (slurm.conf overrides the hardware: the nodes share this machine's cores).
NODE_CPUS = 2
#: Keys of the single-node configuration this one replaces.
_REPLACED = ("SlurmctldHost=", "SlurmdSpoolDir=", "SlurmdPidFile=", "SlurmdLogFile=", "NodeName=", "PartitionName=")


class NamespacesUnavailable(RuntimeError):
    """Network namespaces, veth pairs or bridges cannot be made here (not root, no `ip`, a sandbox refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def netns_unavailable_reason() -> str | None:
    """Why this machine cannot host the simulated nodes (None: it can). Tries a namespace and a veth pair."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if any(shutil.which(tool) is None for tool in ("ip", "unshare", "nsenter")):
        return "`ip` (iproute2), `unshare` or `nsenter` (util-linux) is not installed"
    probe = f"plprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", f"{probe[:11]}a", "type", "veth", "peer", "name", f"{probe[:11]}b", "netns", probe)
    except NamespacesUnavailable as exc:
        return str(exc)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class MultiNodeCluster(SlurmCluster):
    """munged + slurmctld in the root namespace, one slurmd per node namespace (see the module docstring)."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        super().__init__(root)
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.subnet = random.randrange(1, 250)
        self.bridge = f"plb{self.tag}"
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.netns = {name: f"pl{self.tag}n{i + 1}" for i, name in enumerate(self.names)}
        self.addrs = {name: self.addr(i + 1) for i, name in enumerate(self.names)}
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name): what stop() deletes

    def addr(self, host: int) -> str:
        return f"10.77.{self.subnet}.{host}"

    @property
    def head_addr(self) -> str:
        """The root namespace's address on the bridge (slurmctld's)."""
        return self.addr(254)

    # ---------------------------------------------------------------- network
    def make_network(self) -> None:
        """The bridge in the root namespace and, per node, a namespace joined to it by a veth pair."""
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.head_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, host_end = self.netns[name], f"pl{self.tag}h{i + 1}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", host_end))
            _ip("link", "set", host_end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        hosts = ["127.0.0.1 localhost", *(f"{a} {n}" for n, a in self.addrs.items())]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def set_link(self, node: str, up: bool) -> None:
        """Cut (or restore) a node's only link: its traffic to every other node and to slurmctld stops."""
        i = self.names.index(node) + 1
        _ip("link", "set", f"pl{self.tag}h{i}", "up" if up else "down")

    def delete_network(self) -> None:
        """Delete what make_network made (namespaces take their veth ends with them)."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()

    # ---------------------------------------------------------------- configuration
    def write_conf(self) -> None:
        """The single-node slurm.conf with the controller on the bridge address and one line per node."""
        super().write_conf()
        kept = [line for line in self.conf.read_text().splitlines() if not line.startswith(_REPLACED)]
        r = self.root
        host = next(line for line in self.conf.read_text().splitlines() if line.startswith("SlurmctldHost="))
        ctld_name = host.split("=", 1)[1].split("(")[0]
        lines = [*kept,
                 f"SlurmctldHost={ctld_name}({self.head_addr})",
                 f"SlurmdSpoolDir={r / 'spool'}/%n",
                 f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                 f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
                 # A node whose link the failure test cuts for a while stays in the job (the harness, not Slurm,
                 # is what that test watches).
                 "SlurmdTimeout=300",
                 *(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={NODE_CPUS} RealMemory=1024 State=UNKNOWN"
                   for n, a in self.addrs.items()),
                 "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"]
        self.conf.write_text("\n".join(lines) + "\n")
        self.node_name = self.names[0]

    # ---------------------------------------------------------------- daemons
    def node_command(self, node: str, cmd: list[str]) -> list[str]:
        """`cmd` run inside `node`: its network namespace, its own host name and /etc/hosts."""
        inner = (f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {node} && exec "
                 + " ".join(f"'{c}'" for c in cmd))
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys without /sys/fs/cgroup, which slurmd reads.
        return ["nsenter", f"--net=/run/netns/{self.netns[node]}", "unshare", "--uts", "--mount", "sh", "-c", inner]

    def start_slurmd(self, node: str) -> None:
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        # The PID we keep is slurmd's own: ip, unshare and sh each exec the next.
        self._spawn(f"slurmd-{node}", self.node_command(node, [_sbin("slurmd"), "-D", "-N", node, "-f",
                                                               str(self.conf)]), self.env())

    def start(self, timeout_s: float = 60) -> None:
        """Network, munged, slurmctld, one slurmd per node; returns once every node is idle."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.make_network()
        self._write_munge()
        self._start_munged()
        self.write_conf()
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], self.env())
        for node in self.names:
            self.start_slurmd(node)
        self._start_reaper()
        self._wait_for(self._node_idle, f"{len(self.names)} idle nodes", timeout_s)

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True, text=True,
                             timeout=10)
        states = dict(line.split() for line in out.stdout.strip().splitlines() if len(line.split()) == 2)
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def _start_reaper(self) -> None:
        """The single-node reaper, then the namespaces and links deleted once the daemons are gone."""
        super()._start_reaper()
        deletes = "; ".join(f"ip netns del {n}" if k == "netns" else f"ip link del {n}"
                            for k, n in reversed(self._made))
        # Polls our PID, not the reaper's (an exited reaper may stay a zombie where nothing reaps it), then gives
        # the reaper the time it takes to stop the daemons.
        script = f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; sleep 12; {deletes} 2>/dev/null; exit 0"
        self.net_reaper = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True)

    def node_pids(self, node: str) -> list[int]:
        """PIDs of every process in `node`'s network namespace (its slurmd, job steps and ranks)."""
        out = _ip("netns", "pids", self.netns[node], check=False)
        return [int(p) for p in out.stdout.split()]

    def stop(self) -> None:
        """Stop jobs and daemons (by PID), kill what is left in the node namespaces, delete the network."""
        try:
            super().stop()
        finally:
            for node in self.names:
                for pid in self.node_pids(node) if any(k == "netns" for k, _ in self._made) else []:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.2 if self._made else 0)
            self.delete_network()
            reaper = getattr(self, "net_reaper", None)
            if reaper is not None and reaper.poll() is None:
                reaper.kill()
                reaper.wait(timeout=10)


def main(argv: list[str]) -> int:
    """Start a cluster in argv[0] (default: a new temporary folder) with argv[1] nodes; keep it up until Ctrl-C."""
    import tempfile

    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="peerline-slurm-multi-"))
    cluster = MultiNodeCluster(root, int(argv[1]) if len(argv) > 1 else 3)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # sigwait below receives them
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}   # nodes: "
              + ", ".join(f"{n}={a} ({cluster.netns[n]})" for n, a in cluster.addrs.items()), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except SlurmUnavailable as exc:
        print(f"cluster did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
