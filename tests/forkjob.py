"""CPU test jobs forked from a process that has imported torch and peerline once.

A small CPU job spends most of its time importing: torch, torch._dynamo (torch.optim's first optimizer imports it)
and peerline take about five seconds of CPU in every process, against well under a second of training. Here one
process imports them and every job is a fork of it:

    python tests/forkjob.py --nproc_per_node=N launch/pipeline.py [flags...]   one job, its N ranks forked
    ForkServer.shared().run(cmd, cwd, env, timeout)                             a test's job, from a server that
                                                                                imported once per test session
    ForkServer.shared().run_ranks(cmd, cwd, env, timeout)                       the same, each rank's own exit
                                                                                code, output and exit time

The job is launch/pipeline.py, launch/bench.py, or (one process) `python -m peerline.launch.export_checkpoint`. A job
of N ranks gets torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so peerline sees the job torchrun would start; N=1 is
`python launch/pipeline.py`. Tests whose subject is a launcher (torchrun's agent, mpirun, signals, restarts) start
real processes instead; so does every test with PEERLINE_TEST_FORKSERVER=0.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(1, str(REPO))  # run as a script: `tests` and the checkout's `peerline` importable

from tests.ports import free_port  # noqa: E402

PIPELINE = str(REPO / "launch" / "pipeline.py")
BENCH = str(REPO / "launch" / "bench.py")
EXPORT = "peerline.launch.export_checkpoint"  # run as `python -m EXPORT`
SCRIPT = str(Path(__file__).resolve())
GRACE_S = 30.0  # how long the other ranks may take to end on their own once one failed (their own deadlines)
ABORT_S = 10.0  # run_ranks' timeout: how long a rank sent SIGABRT may take to write its stacks before SIGKILL


def enabled() -> bool:
    """Whether tests fork their jobs from the server (PEERLINE_TEST_FORKSERVER=0: real processes)."""
    return os.environ.get("PEERLINE_TEST_FORKSERVER", "1") != "0"


def import_once() -> dict[str, object]:
    """Everything a job imports that is slow, imported here once; returns each script's entry point. CUDA stays
    uninitialized: the jobs are forks of this process."""
    import torch
    import torch._dynamo  # noqa: F401 - torch.optim's first optimizer imports it (seconds)
    import torch.distributed.checkpoint  # noqa: F401 - checkpoints import it on first use (a second)

    from peerline.bench.main import main as bench
    from peerline.launch.export_checkpoint import main as export
    from peerline.launch.pipeline import main as pipeline
    if torch.cuda.is_initialized():
        raise RuntimeError("importing the jobs' modules initialized CUDA, which a fork cannot use")
    return {PIPELINE: pipeline, BENCH: bench, EXPORT: export}


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def _run_main(main, argv: list[str]) -> int:
    """main's exit code; an exception that escapes it prints its traceback, as the interpreter of a real process
    would (a fork ends with os._exit, which prints nothing), and is exit code 1."""
    try:
        return main(argv) or 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to a real process
        traceback.print_exc()
        return 1


def _rank(main, argv: list[str], rank: int, nproc: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 1
    try:
        code = _run_main(main, argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): /proc/<pid>/stat state T."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _wait(pids: set[int]) -> int:
    """Reap every rank; once one failed, stop the rest after GRACE_S, or at once when all that are left are
    stopped (a `stop` fault: torchrun would wait 30 s for them, which tests need not). The first failure's exit
    code, else 0."""
    first, failed_at = 0, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and (time.monotonic() - failed_at > GRACE_S or all(map(_stopped, pids))):
                for p in pids:
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.02)
            continue
        pids.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first == 0:
            first, failed_at = (code if code > 0 else 128 - code), time.monotonic()
    return first


def run_job(main, argv: list[str], nproc: int) -> int:
    """The job's exit code: `main(argv)` here (nproc 1) or in nproc forked ranks."""
    if nproc == 1:
        return _run_main(main, argv)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = set()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(main, argv, rank, nproc, port)
        pids.add(pid)
    return _wait(pids)


def split_command(cmd: list[str]) -> tuple[str, int, list[str]] | None:
    """(script, nproc, its flags) of a command this module can run: `python SCRIPT ...`,
    `python tests/forkjob.py --nproc_per_node=N SCRIPT ...`, SCRIPT launch/pipeline.py or launch/bench.py, or
    `python -m peerline.launch.export_checkpoint ...` (EXPORT, one process); None for any other command."""
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1] in (PIPELINE, BENCH):
        return cmd[1], 1, cmd[2:]
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1:3] == ["-m", EXPORT]:
        return EXPORT, 1, cmd[3:]
    if len(cmd) >= 4 and cmd[0] == sys.executable and cmd[1] == SCRIPT and cmd[3] in (PIPELINE, BENCH):
        return cmd[3], int(cmd[2].split("=", 1)[1]), cmd[4:]
    return None


def _redirect(out: str, err: str) -> None:
    """stdout and stderr (the file descriptors) to the files `out` and `err`."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _run_ranks(main, argv: list[str], nproc: int, outs: list[str], errs: list[str], conn: socket.socket) -> None:
    """Fork nproc ranks, each writing to its own files, and answer `rank exit-code seconds stopped` on conn as each
    ends (the exit code as Popen's returncode; the seconds since the job started; when it was first seen stopped by
    SIGSTOP, or `-`). No rank is ended because another failed: each rank's own behaviour is what the tests check,
    except that once some rank has ended and every rank still running is stopped (a `stop` fault, a frozen node),
    those are killed: a stopped rank cannot go on. `abort` from the client ends the ranks still running: SIGABRT
    (faulthandler writes every thread's stack), then SIGKILL after ABORT_S."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _redirect(outs[rank], errs[rank])
            if os.environ.get("PYTHONFAULTHANDLER"):  # what the interpreter does at start-up with this variable
                faulthandler.enable()
            _rank(main, argv, rank, nproc, port)
        pids[pid] = rank
    aborted_at, stopped_at = None, {}
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            stopped = f"{stopped_at[pid]:.3f}" if pid in stopped_at else "-"
            conn.sendall(f"{pids.pop(pid)} {code} {time.monotonic() - t0:.3f} {stopped}\n".encode())
            continue
        for p in pids:
            if p not in stopped_at and _stopped(p):
                stopped_at[p] = time.monotonic() - t0
        if len(pids) < nproc and all(p in stopped_at for p in pids):
            for p in pids:
                os.kill(p, signal.SIGKILL)
        if aborted_at is None and select.select([conn], [], [], 0)[0]:  # `abort`, or the client is gone
            aborted_at = time.monotonic()
            for p in pids:
                os.kill(p, signal.SIGABRT)
        elif aborted_at is not None and time.monotonic() - aborted_at > ABORT_S:
            for p in pids:
                os.kill(p, signal.SIGKILL)
        time.sleep(0.02)


# ---- the server: one per test process, started on first use


def _serve_one(conn: socket.socket, mains: dict[str, object]) -> None:
    """In a fork of the server: become the request's job (its folder, environment, output files) and answer
    its exit code, or each rank's (a `ranks` request)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # its own process group: the client stops the whole job on its timeout
    request = json.loads(conn.makefile().readline())
    conn.sendall(f"{os.getpid()}\n".encode())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    main = mains[request["script"]]
    sys.argv = [request["script"], *request["argv"]]
    if request["ranks"]:
        try:
            _run_ranks(main, request["argv"], request["nproc"], request["out"], request["err"], conn)
        finally:
            os._exit(0)
    _redirect(request["out"], request["err"])
    code = 1
    try:
        code = run_job(main, request["argv"], request["nproc"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(f"{code}\n".encode())
        os._exit(0)


def serve(path: str) -> None:
    """Accept requests on the unix socket `path` and fork one job for each; ends when its parent does."""
    mains = import_once()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # jobs reap themselves
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    parent = os.getppid()
    server.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            server.close()
            _serve_one(conn, mains)
        conn.close()


@dataclass
class RankExit:
    """One rank of ForkServer.run_ranks: its exit code (Popen's returncode: minus the signal that ended it), the
    seconds from the job's start to its exit, its output, whether it was still running at the timeout, and the
    seconds from the job's start to the moment it was first seen stopped (SIGSTOP; None: never)."""

    rc: int
    seconds: float
    out: str
    err: str
    timed_out: bool
    stopped_s: float | None = None


class RanksTimeout(Exception):
    """ForkServer.run_ranks' timeout passed: `ranks` holds every rank's exit and output, those ended then too."""

    def __init__(self, ranks: list[RankExit]) -> None:
        super().__init__(f"ranks {[r for r, e in enumerate(ranks) if e.timed_out]} still running")
        self.ranks = ranks


class _Lines:
    """The lines a job's leader answers on its socket, each read by a deadline."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""

    def read(self, deadline: float) -> str | None:
        """The next line; None at the deadline or when the leader closed the socket."""
        while b"\n" not in self.buffer:
            self.conn.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                chunk = self.conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def collect(self, exits: dict[int, tuple[int, float, float | None]], nproc: int, deadline: float) -> None:
        """Read `rank code seconds stopped` lines into exits until all nproc ranks are in, or the deadline."""
        while len(exits) < nproc and (line := self.read(deadline)) is not None:
            rank, code, seconds, stopped = line.split()
            exits[int(rank)] = (int(code), float(seconds), None if stopped == "-" else float(stopped))


class ForkServer:
    """The client: starts `python tests/forkjob.py --serve` once and runs jobs through it."""

    _shared: ForkServer | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="peerline-forkjob-"))
        self.path = str(self.folder / "socket")
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--serve", self.path], stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the fork server did not start")

    @classmethod
    def shared(cls) -> ForkServer:
        with cls._lock:
            if cls._shared is None or cls._shared.proc.poll() is not None:
                cls._shared = cls()
            return cls._shared

    def run(self, cmd: list[str], cwd: str | os.PathLike, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """Like subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) for a command that
        split_command accepts."""
        script, nproc, argv = split_command(cmd)
        out, err = (self._new_file(suffix) for suffix in (".out", ".err"))
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.path)
            request = {"script": script, "argv": argv, "nproc": nproc, "ranks": False, "cwd": str(cwd), "env": env,
                       "out": out, "err": err}
            conn.sendall((json.dumps(request) + "\n").encode())
            reader = conn.makefile()
            pid = int(reader.readline())
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout, self._read(out), self._read(err)) from None
        code = int(line) if line.strip() else -signal.SIGKILL
        return subprocess.CompletedProcess(cmd, code, self._read(out), self._read(err))

    def run_ranks(self, cmd: list[str], cwd: str | os.PathLike, env: dict[str, str],
                  timeout: float) -> list[RankExit]:
        """Each rank's exit of a command that split_command accepts, its ranks forked with torchrun's variables
        (one rank too) and left to end on their own (stopped ones are killed once they are all that is left). Past
        `timeout`, the ranks still running are sent SIGABRT, then the job is killed, and RanksTimeout carries every
        rank's exit and output."""
        script, nproc, argv = split_command(cmd)
        files = [[self._new_file(f".r{rank}{suffix}") for suffix in (".out", ".err")] for rank in range(nproc)]
        exits: dict[int, tuple[int, float, float | None]] = {}
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.path)
            request = {"script": script, "argv": argv, "nproc": nproc, "ranks": True, "cwd": str(cwd), "env": env,
                       "out": [out for out, _ in files], "err": [err for _, err in files]}
            conn.sendall((json.dumps(request) + "\n").encode())
            deadline = time.monotonic() + timeout
            lines = _Lines(conn)
            pid = int(lines.read(deadline) or "0")
            if not pid:
                raise RuntimeError("the fork server did not start the job")
            lines.collect(exits, nproc, deadline)
            running = [rank for rank in range(nproc) if rank not in exits]
            if running:
                if time.monotonic() < deadline:
                    raise RuntimeError(f"the fork server's job {pid} ended before its ranks {running}")
                conn.sendall(b"abort\n")
                lines.collect(exits, nproc, time.monotonic() + ABORT_S + 5)
                with contextlib.suppress(ProcessLookupError):  # the job's leader ends once every rank did
                    os.killpg(pid, signal.SIGKILL)
        ranks = []
        for rank, (out, err) in enumerate(files):
            code, seconds, stopped = exits.get(rank, (-signal.SIGKILL, timeout, None))
            ranks.append(RankExit(code, seconds, self._read(out), self._read(err), rank in running, stopped))
        if running:
            raise RanksTimeout(ranks)
        return ranks

    def _new_file(self, suffix: str) -> str:
        fd, path = tempfile.mkstemp(dir=self.folder, suffix=suffix)
        os.close(fd)
        return path

    @staticmethod
    def _read(path: str) -> str:
        text = Path(path).read_text(errors="replace")
        os.unlink(path)
        return text


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--serve"]:
        serve(args[1])
        return 0
    nproc = 1
    if args and args[0].startswith("--nproc"):
        value = args.pop(0).split("=", 1)
        nproc = int(value[1] if len(value) == 2 else args.pop(0))
    script, argv = str(Path(args[0]).resolve()), args[1:]
    sys.argv = [script, *argv]
    return run_job(import_once()[script], argv, nproc)


if __name__ == "__main__":
    sys.exit(main())
