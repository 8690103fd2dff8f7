"""A throw-away single-node Slurm (munged + slurmctld + slurmd) in a temporary folder, for CI.

Everything lives under one folder: a private munge key and socket, slurm.conf, state, spool, pid and log files.
The daemons run in the foreground as children of this process (so we own their PIDs) and listen on free ports,
so a system Slurm or munged on the same machine is neither used nor disturbed. Clients find the cluster through
`SLURM_CONF`, which `env()` sets and which sbatch hands on to the job and its srun steps.

Also usable by hand while developing the batch scripts:

    python tests/slurm/slurm_cluster.py /tmp/slurm-dev     # starts, prints the env to use, stops on Ctrl-C
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The Debian packages that provide the daemons and the client commands.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
#: Executables the cluster needs; any one missing means "install".
EXECUTABLES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
#: How often SlurmCluster.sbatch asks for a job's state (`sbatch --wait` asks every 2 s: a second lost per job).
POLL_S = 0.25
#: Job states of a job that has ended (sbatch's IS_JOB_FINISHED; COMPLETING: ended, its node still cleaning up).
FINISHED = ("COMPLETED", "COMPLETING", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE", "OUT_OF_MEMORY")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (not root, no apt-get, install failed)."""


def skip_or_fail(reason: str) -> None:
    """pytest: skip with the reason, or fail when PEERLINE_REQUIRE_SLURM=1 (CI must not skip silently)."""
    import pytest

    if os.environ.get("PEERLINE_REQUIRE_SLURM") == "1":
        pytest.fail(f"PEERLINE_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def missing_executables() -> list[str]:
    """Names from EXECUTABLES that are not on PATH (the daemons live in /usr/sbin, added here if absent)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in EXECUTABLES if shutil.which(name, path=path) is None]


def ensure_installed(timeout_s: float = 600) -> None:
    """Install Slurm and munge from the distribution's packages if any executable is missing.

    Raises SlurmUnavailable with a one-line reason when that is impossible (not root, no apt-get) or fails.
    """
    missing = missing_executables()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing) and we are not root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing) and apt-get is unavailable")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` took more than {timeout_s:.0f} s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: {tail[0]}")
    still = missing_executables()
    if still:
        raise SlurmUnavailable(f"installed {' '.join(PACKAGES)} but {', '.join(still)} still missing")


def _free_port() -> int:
    """A TCP port that was free a moment ago (the daemons bind it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise SlurmUnavailable(f"{name} not found")
    return found


@dataclass
class JobResult:
    """What one script submitted and waited for gave (as `sbatch --wait` would): its exit code, job id and log."""

    returncode: int
    job_id: int | None
    log_path: Path | None
    log: str
    sbatch_output: str

    def describe(self) -> str:
        """Everything a failing assertion should show."""
        return (f"sbatch rc={self.returncode} job={self.job_id}\n--- sbatch output ---\n{self.sbatch_output}"
                f"\n--- job log {self.log_path} ---\n{self.log}")


class SlurmCluster:
    """One node, one partition (`debug`), daemons owned by this object; `stop()` always kills them by PID."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    # ---------------------------------------------------------------- set-up
    def _write_munge(self) -> None:
        mdir = self.root / "munge"
        mdir.mkdir(parents=True, exist_ok=True)
        key = mdir / "munge.key"
        subprocess.run([_sbin("mungekey"), "--create", "--force", f"--keyfile={key}"], check=True,
                       capture_output=True, timeout=30)

    def _start_munged(self) -> None:
        mdir = self.root / "munge"
        # --force: munged refuses to run as root, or with a key in a world-readable folder, without it.
        cmd = [_sbin("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
               f"--key-file={mdir / 'munge.key'}", f"--pid-file={mdir / 'munged.pid'}",
               f"--log-file={mdir / 'munged.log'}", f"--seed-file={mdir / 'munged.seed'}"]
        self._spawn("munged", cmd)
        self._wait_for(lambda: self.munge_socket.exists(), "munged socket", 10)

    def _node_line(self) -> str:
        """`slurmd -C`'s node definition (exact CPUs, sockets, cores, memory: no mismatch warnings)."""
        out = subprocess.run([_sbin("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True)
        line = out.stdout.strip().splitlines()[0]
        if not line.startswith("NodeName="):
            raise SlurmUnavailable(f"unexpected `slurmd -C` output: {line!r}")
        return line

    def write_conf(self) -> None:
        """slurm.conf with every path under root, ports chosen free, host names pinned to 127.0.0.1."""
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        node_line = self._node_line()
        self.node_name = re.match(r"NodeName=(\S+)", node_line).group(1)
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=ci",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CryptoType=crypto/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            # Finished jobs stay in slurmctld for 5 s: SlurmCluster.sbatch, polling every POLL_S, sees each one's end.
            "MinJobAge=5",
            # A job that can never fit (more tasks than CPUs) is rejected at submit instead of pending forever.
            "EnforcePartLimits=ALL",
            "MailProg=/bin/true",
            # Job ids (and with them the scripts' rendezvous ports, 20000 + id % 20000) differ between sessions,
            # so two CI runs on one machine, or a leftover job, do not meet on the same port.
            f"FirstJobId={random.randrange(1000, 1_000_000)}",
            "KillWait=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for client commands (sbatch, sinfo, ...): SLURM_CONF points at our slurm.conf."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        # Our own Slurm variables must not leak in when the tests themselves run inside a Slurm job.
        for key in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "SBATCH_"))]:
            env.pop(key)
        return env

    def start(self, timeout_s: float = 30) -> None:
        """Write the configuration and start munged, slurmctld, slurmd; return once the node is idle."""
        self.root.mkdir(parents=True, exist_ok=True)
        # slurmstepd and the jobs (root here) read files under root; keep it traversable.
        os.chmod(self.root, 0o755)
        self._write_munge()
        self._start_munged()
        self.write_conf()
        env = self.env()
        # -D: stay in the foreground (we own the PID); -i: ignore any saved state.
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], env)
        self._spawn("slurmd", [_sbin("slurmd"), "-D", "-f", str(self.conf)], env)
        self._start_reaper()
        self._wait_for(self._node_idle, "the node to become idle", timeout_s)

    def _start_reaper(self) -> None:
        """A watchdog shell that stops our daemons by PID if this process dies without calling stop().

        pytest-timeout's thread method and SIGKILL end the test process without running fixture finalizers or
        atexit handlers; the daemons would outlive it. The reaper polls our PID every second.
        """
        pids = " ".join(str(p.pid) for p in self.procs.values())
        # Jobs first (their steps outlive slurmd), then the daemons.
        script = (f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; "
                  f"SLURM_CONF={self.conf} timeout 10 scancel --user {os.geteuid()} 2>/dev/null; sleep 3; "
                  f"kill -TERM {pids} 2>/dev/null; sleep 5; kill -KILL {pids} 2>/dev/null; exit 0")
        self.reaper = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                             timeout=10)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        out = open(self.root / f"{name}.stdout", "wb")  # the child keeps its own copy of the descriptor
        # start_new_session: a Ctrl-C in the terminal reaches pytest, which then stops the daemons itself.
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        out.close()

    def _wait_for(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with code {proc.returncode} while waiting for {what}:"
                                           f" {self.daemon_logs()[-2000:]}")
            if ready():
                return
            time.sleep(0.1)
        raise SlurmUnavailable(f"timed out after {timeout_s:.0f} s waiting for {what}: {self.daemon_logs()[-2000:]}")

    # ---------------------------------------------------------------- tear-down
    def cancel_jobs(self, timeout_s: float = 15) -> None:
        """Cancel every job of this cluster and wait until none is left.

        A job step (slurmstepd and the ranks under it) outlives slurmd by design, so jobs left running by a
        failed or timed-out test must end before the daemons do.
        """
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        env = self.env()
        try:
            subprocess.run(["scancel", "--user", str(os.geteuid())], env=env, capture_output=True,
                           timeout=10)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True,
                                     timeout=10)
                if out.returncode != 0 or not out.stdout.strip():
                    return
                time.sleep(0.5)
            log.warning("jobs still listed after scancel: %s", out.stdout.strip())
        except subprocess.TimeoutExpired:
            log.warning("scancel/squeue did not answer")

    def stop(self) -> None:
        """Cancel leftover jobs, then stop every daemon we started, by PID: SIGTERM, then SIGKILL after 10 s.

        Safe to call twice, and after a failed start().
        """
        self.cancel_jobs()
        # Reverse start order: slurmd (and its job steps) first, munged last.
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) ignored SIGTERM; killing it", name, proc.pid)
                    proc.kill()
                    proc.wait(timeout=10)
        reaper = getattr(self, "reaper", None)
        if reaper is not None and reaper.poll() is None:
            reaper.kill()
            reaper.wait(timeout=10)

    def daemon_logs(self) -> str:
        """The daemons' logs, for failure messages."""
        parts = []
        for path in sorted(self.root.glob("*.stdout")) + sorted((self.root / "log").glob("*.log")):
            try:
                parts.append(f"== {path.name} ==\n{path.read_text(errors='replace')[-4000:]}")
            except OSError:
                pass
        return "\n".join(parts)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, script: Path, args: list[str] = (), *, options: list[str] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None, log_dir: Path | None = None, timeout_s: float = 240) -> JobResult:
        """`sbatch [options] script [args]`, then wait for the job's end; returns its exit code and its log: what
        `sbatch --wait` returns (the job's exit code, or 1 when a signal ended it; sbatch's own when it refused
        the job), found by polling every POLL_S instead of its 2 s.

        The log is written to log_dir/<job name>_<job id>.out (the scripts' own `%x_%j.out` naming).
        """
        log_dir = Path(log_dir or self.root / "jobs")
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = ["sbatch", "--parsable", f"--output={log_dir}/%x_%j.out", *options, str(script), *args]
        deadline = time.monotonic() + timeout_s
        proc = subprocess.run(cmd, env=self.env(env), cwd=cwd, capture_output=True, text=True,
                              timeout=min(60.0, timeout_s))
        output = (proc.stdout + proc.stderr).strip()
        match = re.search(r"^(\d+)", proc.stdout.strip())
        job_id = int(match.group(1)) if match and proc.returncode == 0 else None
        returncode = proc.returncode
        log_path = None
        text = ""
        if job_id is not None:
            returncode = self.wait_job(job_id, deadline, cmd)
            found = sorted(log_dir.glob(f"*_{job_id}.out"))
            if found:
                log_path = found[0]
                text = log_path.read_text(errors="replace")
        return JobResult(returncode, job_id, log_path, text, output)

    def wait_job(self, job_id: int, deadline: float, cmd: list[str]) -> int:
        """The exit code of job `job_id` once it has ended (`sbatch --wait`'s: the script's exit status, or 1 when
        a signal ended it); AssertionError past `deadline` (time.monotonic())."""
        while True:
            out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=self.env(), capture_output=True,
                                 text=True, timeout=10)
            state = re.search(r"\bJobState=(\S+)", out.stdout)
            code = re.search(r"\bExitCode=(\d+):(\d+)", out.stdout)
            if state and code and state.group(1) in FINISHED:
                return int(code.group(1)) if code.group(2) == "0" else 1
            if out.returncode != 0 and "Invalid job id" in out.stderr:
                raise AssertionError(f"job {job_id} left slurmctld before its end was seen: {cmd}")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} did not end in time: {cmd}\n{self.daemon_logs()[-3000:]}")
            time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    """Start a cluster in argv[0] (default: a new temporary folder) and keep it up until Ctrl-C."""
    import tempfile

    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="peerline-slurm-"))
    ensure_installed()
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}   # daemons: "
              + ", ".join(f"{n}={p.pid}" for n, p in cluster.procs.items()), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
