"""Start the ranks of a failure test with torchrun's environment variables and no agent, so each rank's own exit code
and stderr can be checked: forked from the test fork server (tests/forkjob.py: ForkServer.run_ranks), or as plain
processes with PEERLINE_TEST_FORKSERVER=0; shared by tests/multiproc/test_failures.py and
tests/gpu/test_failures_gpu.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests import forkjob
from tests.helpers import REPO, forkrun_cmd
from tests.ports import free_port

STARTUP_S = 60  # importing torch on a loaded 2-core CI machine, rendezvous, CUDA context


def _entry() -> str:
    """launch/pipeline.py once it carries the failure flags, else the test driver with the same flow."""
    from peerline.launch.cli import build_parser

    if "--save" in build_parser()._option_string_actions:
        return str(REPO / "launch" / "pipeline.py")
    return str(REPO / "tests" / "multiproc" / "failures_main.py")


ENTRY = _entry()


@dataclass
class Rank:
    rc: int
    out: str
    err: str
    seconds: float

    def errors(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("peerline: error:")]


class Hang(AssertionError):
    pass


def spawn(n: int, args: list[str], cwd: Path, env: dict[str, str], limit_s: float = 120) -> list[Rank]:
    """Start n ranks of ENTRY with `args`; wait at most limit_s for all of them, else kill them and raise Hang."""
    cmd = [*forkrun_cmd(n), ENTRY, *args]
    # CPU jobs only: the GPU failure tests (tests/gpu/test_failures_gpu.py) keep real processes, one CUDA context each.
    if env.get("PEERLINE_DEVICE") == "cpu" and forkjob.enabled() and forkjob.split_command(cmd):
        # PYTHONFAULTHANDLER: a hung rank's report carries every thread's stack (SIGABRT at the timeout).
        try:
            exits = forkjob.ForkServer.shared().run_ranks(cmd, cwd, dict(env, PYTHONFAULTHANDLER="1"), limit_s)
        except forkjob.RanksTimeout as exc:
            tails = "\n".join(_tail(r, e.rc, e.out + e.err, e.timed_out) for r, e in enumerate(exc.ranks))
            raise Hang(f"ranks still running after {limit_s} s: {' '.join(args)}\n{tails}") from None
        return [Rank(e.rc, e.out, e.err, e.seconds) for e in exits]
    port = str(free_port())
    procs = []
    t0 = time.monotonic()
    for r in range(n):
        # PYTHONFAULTHANDLER: a hung rank's report carries every thread's stack (see _tails).
        rank_env = dict(env, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONFAULTHANDLER="1")
        procs.append(subprocess.Popen([sys.executable, ENTRY, *args], cwd=cwd, env=rank_env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    ranks = []
    try:
        for p in procs:
            left = max(1.0, limit_s - (time.monotonic() - t0))
            out, err = p.communicate(timeout=left)
            ranks.append(Rank(p.returncode, out, err, time.monotonic() - t0))
    except subprocess.TimeoutExpired:
        raise Hang(f"ranks still running after {limit_s} s: {' '.join(args)}\n{_tails(procs, ranks)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return ranks


def _tail(rank: int, rc: int | None, text: str, hung: bool, chars: int = 1500) -> str:
    """One rank's part of a hang's report: its exit code and what it wrote last (more of a hung rank's: its
    stacks)."""
    return f"--- rank {rank} (exit {rc}), last output:\n{text[-(4 * chars if hung else chars):]}"


def _tails(procs: list[subprocess.Popen], done: list[Rank]) -> str:
    """End the ranks still running and return what each rank wrote last (those already ended included), so a
    hang's report says where every rank stood. A running rank first gets SIGABRT: faulthandler (which needs no
    GIL) writes every thread's Python stack, then it is killed."""
    parts = []
    for r, p in enumerate(procs):
        hung = False
        if r < len(done):
            rc, text = done[r].rc, done[r].out + done[r].err
        else:
            hung = p.poll() is None
            if hung:
                p.send_signal(signal.SIGABRT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            out, err = p.communicate()
            rc, text = p.returncode, out + err
        parts.append(_tail(r, rc, text, hung))
    return "\n".join(parts)


def losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]
