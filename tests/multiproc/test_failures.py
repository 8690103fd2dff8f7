"""Failure behaviour on the CPU (gloo), every run bounded in time (issue 10).

Ranks are started with torchrun's environment variables and no launcher, so each rank's own exit code and stderr
can be checked (torchrun and mpirun would end the survivors themselves): forked from the test fork server
(failures_util.spawn, and ForkServer.run_ranks for the frozen rank, whose freeze it sees in /proc), or real processes
where a fork would change the subject: one test under torchrun (`--max-restarts=1`: killed, restarted, resumed) and
one under mpirun (a killed rank ends the job).

  - resume: 6 iterations == 3 iterations + checkpoint + resume to 6, bitwise; a rank delayed under the deadline
    in the resumed part changes nothing
  - a killed rank: every rank exits non-zero within the deadline; the survivor's one line names the lost rank
  - a hung rank: its watchdog ends it (exit 3) with one line; the peer's line names it
  - a frozen rank (SIGSTOP, as a lost node looks to the others), also the one hosting the rendezvous store: every
    other rank exits within the deadline and a bounded margin, naming it (or the store's host it cannot reach)
  - NaN: every rank stops with the iteration number (exit 1); --skip-nonfinite skips that step on every rank
  - a checkpoint of another grid or model, an unwritable --save: one line, exit 2, on every rank
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerline.distributed.resilience.watchdog import EXIT_MARGIN_S
from tests import forkjob
from tests.helpers import cpu_env, forkrun_cmd, mpirun_cmd, torchrun_cmd
from tests.multiproc.failures_util import ENTRY, STARTUP_S, Rank, losses
from tests.multiproc.failures_util import spawn as _spawn
from tests.ports import free_port

pytestmark = pytest.mark.timeout(240)

MODEL = ["--hidden", "32", "--layers", "4", "--seq", "8", "--micro-batch-size", "2", "-m", "4", "--device", "cpu"]


def spawn(n: int, args: list[str], tmp: Path, fault: str = "", limit_s: float = 120):
    return _spawn(n, [*MODEL, *args], tmp, cpu_env(PEERLINE_FAULT=fault), limit_s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 6-iteration run and a 3-iteration run that saves, on 2 ranks (pp=2)."""
    tmp = tmp_path_factory.mktemp("runs")
    full = spawn(2, ["--iters", "6", "--json", "full.json"], tmp)
    assert all(r.rc == 0 for r in full), full[0].err + full[1].err
    first = spawn(2, ["--iters", "3", "--save", "ck", "--save-every", "3", "--json", "first.json"], tmp)
    assert all(r.rc == 0 for r in first), first[0].err + first[1].err
    return tmp


def test_resume_gives_the_losses_of_an_uninterrupted_run(runs):
    full = losses(runs / "full.json")
    assert len(full) == 6 and all(math.isfinite(v) for v in full)
    assert losses(runs / "first.json") == full[:3]
    ck = runs / "ck"
    assert (ck / "latest").read_text().strip() == "3"
    assert sorted(p.name for p in (ck / "iter_000003").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    # Resume to 6; rank 0 is slowed down by 1.5 s before iteration 5, well under the 30 s deadline.
    resumed = spawn(2, ["--iters", "6", "--resume", "ck", "--timeout-s", "30", "--json", "resumed.json"], runs,
                    fault="delay:rank=0:iter=5:s=1.5")
    assert all(r.rc == 0 for r in resumed), resumed[0].err + resumed[1].err
    assert "sleeps 1.5 s before iteration 5" in resumed[0].err
    got = json.loads((runs / "resumed.json").read_text())
    assert got["iterations"] == [4, 5, 6]
    assert got["losses"] == full[3:], "the resumed run differs from the uninterrupted one"
    assert f"final loss={full[-1]:.9g} iterations=6" in resumed[0].out


def test_killed_rank_every_rank_exits_nonzero_naming_the_lost_rank(tmp_path):
    """Rank 1 spends 0.3 s at the start of iteration 2 (longer than its beats' minimum gap, far shorter than their
    period), then dies before iteration 3: the line names it, last seen in iteration 2 or 3 (its beat follows the
    iterations), not where its previous periodic beat left it."""
    ranks = spawn(2, ["--iters", "6", "--timeout-s", "20"], tmp_path,
                  fault="delay:rank=1:iter=2:s=0.3;kill:rank=1:iter=3", limit_s=STARTUP_S + 20 + 15)
    r0, r1 = ranks
    assert r1.rc == 9 and "killed before iteration 3" in r1.err
    assert r0.rc != 0
    assert len(r0.errors()) == 1, r0.err
    line = r0.errors()[0]
    assert line.startswith("peerline: error: rank 0 (stage 0) ") and "; rank 1 (stage 1) " in line, line
    assert "stopped responding: its process died or froze" in line, line
    assert re.search(r"; rank 1 \(stage 1\) \(last seen in iteration [23], ", line), line
    assert "Traceback" not in r0.err


def test_hung_rank_is_ended_by_its_watchdog(tmp_path):
    ranks = spawn(2, ["--iters", "6", "--timeout-s", "6"], tmp_path, fault="hang:rank=1:iter=2",
                  limit_s=STARTUP_S + 6 + 15)
    r0, r1 = ranks
    assert r1.rc == 3, r1.err
    assert len(r1.errors()) == 1 and r1.errors()[0].startswith(
        "peerline: error: rank 1 (stage 1) timed out after 6 s waiting for iteration 2 to finish; this rank stopped "
        "in iteration 2"), r1.err
    assert r0.rc != 0 and len(r0.errors()) == 1, r0.err
    assert "; rank 1 (stage 1) stopped" in r0.errors()[0], r0.err
    assert "Traceback" not in r0.err + r1.err


def test_nan_stops_every_rank_with_the_iteration_number(tmp_path):
    ranks = spawn(2, ["--iters", "5"], tmp_path, fault="nan:stage=1:iter=2")
    assert [r.rc for r in ranks] == [1, 1], ranks[0].err + ranks[1].err
    assert ranks[0].errors() == ["peerline: error: non-finite loss (nan) at iteration 2; rerun with "
                                 "--skip-nonfinite to skip such steps"]
    assert ranks[1].errors() == [] and "Traceback" not in ranks[0].err + ranks[1].err


def test_skip_nonfinite_skips_the_step_on_every_rank(tmp_path, runs):
    ranks = spawn(2, ["--iters", "4", "--skip-nonfinite", "--json", "skip.json"], tmp_path,
                  fault="nan:stage=0:iter=2")
    assert all(r.rc == 0 for r in ranks), ranks[0].err + ranks[1].err
    got = losses(tmp_path / "skip.json")
    full = losses(runs / "full.json")
    assert got[0] == full[0] and math.isnan(got[1]) and all(math.isfinite(v) for v in got[2:])
    assert got[2] != full[2], "iteration 2's step was not skipped"
    assert all("1 step(s) skipped" in r.err for r in ranks)


def test_mismatched_resume_is_one_line_exit_2(runs, tmp_path):
    """Another model shape (--hidden 48 where the checkpoint has 32), resumed on another grid (one process instead
    of pp=2, which alone would reshard: tests/multiproc/test_checkpoint_reshard.py); every other field is covered by
    tests/unit/test_checkpoint.py, every-rank agreement by the unwritable-directory test."""
    (one,) = spawn(1, ["--iters", "6", "--hidden", "48", "--resume", str(runs / "ck")], tmp_path)
    assert one.rc == 2 and len(one.errors()) == 1 and "Traceback" not in one.err, one.err
    assert "does not match this run" in one.errors()[0] and "48" in one.errors()[0], one.errors()


def test_unwritable_save_dir_is_one_line_exit_2(tmp_path):
    (tmp_path / "blocker").write_text("a file, not a directory")
    ranks = spawn(2, ["--iters", "3", "--save", "blocker/ck"], tmp_path)
    for r in ranks:
        assert r.rc == 2, r.err
        assert "Traceback" not in r.err
    # Checked before training: one line for the job (rank 0's), naming the blocking file.
    lines = [line for r in ranks for line in r.errors()]
    assert len(lines) == 1 and "blocker" in lines[0], lines
    assert (tmp_path / "blocker").read_text() == "a file, not a directory"


def test_rank_failing_mid_run_leaves_no_rank_running(tmp_path):
    """Stage 0's output changes shape in iteration 2 (a user-model error, ConfigError on rank 0 only): rank 0 exits
    2 at once with one line, and rank 1, waiting for its activation, ends too, naming rank 0."""
    env = cpu_env(PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    r0, r1 = _spawn(2, [*MODEL, "--model", "failures_models:shape_changer", "--iters", "4", "--timeout-s", "20"],
                    tmp_path, env, limit_s=STARTUP_S + 20 + 15)
    assert r0.rc == 2 and len(r0.errors()) == 1, r0.err
    assert "stage 0 output changed between microbatches: microbatch 1" in r0.errors()[0]
    assert r1.rc != 0 and len(r1.errors()) == 1 and "rank 0" in r1.errors()[0], r1.err
    assert "Traceback" not in r0.err + r1.err


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path, runs):
    """torchrun --max-restarts=1: rank 1 dies before iteration 4, the job restarts, resumes from the checkpoint
    of iteration 2 (the same command line: --resume of its own --save directory), and ends with the losses of an
    uninterrupted run."""
    # torchrun shares its rendezvous TCPStore with the workers by default, and a restarted attempt then reads the
    # previous attempt's gloo/NCCL addresses (pytorch/pytorch#135712): restarts need the store unshared.
    env = cpu_env(PEERLINE_FAULT="kill:rank=1:iter=4", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [*torchrun_cmd(2), "--max-restarts=1", ENTRY, *MODEL, "--iters", "6", "--save", "ck", "--save-every",
           "2", "--resume", "ck", "--timeout-s", "30", "--json", "restart.json"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "killed before iteration 4" in p.stderr
    got = json.loads((tmp_path / "restart.json").read_text())
    full = losses(runs / "full.json")
    assert got["iterations"] == [3, 4, 5, 6], "the restarted job did not resume from the checkpoint of iteration 2"
    assert got["losses"] == full[2:]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "6"


@pytest.mark.slow
def test_mpirun_killed_rank_ends_the_job(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([*mpirun_cmd(2), ENTRY, *MODEL, "--iters", "6", "--timeout-s", "20"], cwd=tmp_path,
                       env=cpu_env(PEERLINE_FAULT="kill:rank=1:iter=3"), capture_output=True, text=True,
                       timeout=STARTUP_S + 20 + 30)
    assert p.returncode != 0
    assert "killed before iteration 3" in p.stderr
    assert time.monotonic() - t0 < STARTUP_S + 20 + 30
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("peerline: error:")]
    assert len(errors) <= 1, errors  # the survivor reports (or mpirun ended it first); never a flood



@pytest.mark.parametrize("fault", ["hang:rank=1:iter=3", "kill:rank=1:iter=3"])
def test_dp2_names_the_rank_that_stopped_not_a_replica(tmp_path, fault):
    """pp=2 x dp=2: rank 3 waits for rank 1 in the gradient all-reduce and rank 2 for rank 3; every survivor's one
    line names rank 1 (from every rank's beats in the store), never the neighbour it waits for."""
    ranks = spawn(4, ["--dp", "2", "--iters", "6", "--timeout-s", "6"], tmp_path, fault=fault,
                  limit_s=STARTUP_S + 6 + 40)
    survivors = [r for i, r in enumerate(ranks) if i != 1]
    for i, r in zip((0, 2, 3), survivors):
        assert r.rc != 0 and len(r.errors()) == 1, (i, r.err)
        assert "; rank 1 (stage 1) " in r.errors()[0] and "Traceback" not in r.err, (i, r.err)
    assert "the gradient all-reduce of stage 1 with rank 1 (replica 0)" in ranks[3].errors()[0], ranks[3].err


def test_a_long_iteration_of_quick_handoffs_is_not_a_hang(tmp_path):
    """The deadline is on progress: stage 0 sleeps 10 ms per microbatch, so with M=300 an iteration takes over 3 s,
    longer than --timeout-s 2, but a handoff completes every few milliseconds; the run finishes with the losses of
    a single-process run."""
    env = cpu_env(PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    args = [*MODEL, "--model", "failures_models:slow_steps", "-m", "300", "--micro-batch-size", "1", "--iters", "1"]
    ranks = _spawn(2, [*args, "--timeout-s", "2", "--json", "long.json"], tmp_path, env, limit_s=STARTUP_S + 120)
    assert all(r.rc == 0 for r in ranks), ranks[0].err + ranks[1].err
    got = json.loads((tmp_path / "long.json").read_text())
    assert got["ms_per_iter"][0] > 3000, f"the iteration took {got['ms_per_iter'][0]:.0f} ms"
    (one,) = _spawn(1, [*args, "--json", "one.json"], tmp_path, env, limit_s=STARTUP_S + 120)
    assert one.rc == 0, one.err
    assert losses(tmp_path / "long.json") == pytest.approx(losses(tmp_path / "one.json"), rel=1e-5)


def _frozen(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def spawn_with_a_frozen_rank(n: int, args: list[str], tmp: Path, fault: str, frozen: int,
                             limit_s: float) -> list[Rank]:
    """Like `spawn`, with rank `frozen` stopping itself (a `stop` fault): each other rank's `seconds` counts from
    the moment it froze to its exit; the frozen rank is killed once the others are out (or at `limit_s`). The
    ranks are forked from the test fork server, which sees the freeze in /proc as this loop does
    (PEERLINE_TEST_FORKSERVER=0: plain processes)."""
    if forkjob.enabled():
        try:
            exits = forkjob.ForkServer.shared().run_ranks([*forkrun_cmd(n), ENTRY, *MODEL, *args], tmp,
                                                          cpu_env(PEERLINE_FAULT=fault), limit_s)
        except forkjob.RanksTimeout as exc:
            exits = exc.ranks
        froze_at = exits[frozen].stopped_s
        assert froze_at is not None, f"rank {frozen} never froze: {exits[frozen].err}"
        return [Rank(e.rc, e.out, e.err, float("inf") if r == frozen or e.timed_out else e.seconds - froze_at)
                for r, e in enumerate(exits)]
    port = str(free_port())
    procs, files = [], []
    for r in range(n):
        env = dict(cpu_env(PEERLINE_FAULT=fault), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        out, err = open(tmp / f"r{r}.out", "w+"), open(tmp / f"r{r}.err", "w+")  # noqa: SIM115 - closed below
        files.append((out, err))
        procs.append(subprocess.Popen([sys.executable, ENTRY, *MODEL, *args], cwd=tmp, env=env, stdout=out,
                                      stderr=err, text=True))
    t0, froze_at, ended = time.monotonic(), None, {}
    try:
        while time.monotonic() - t0 < limit_s and len(ended) < n - 1:
            if froze_at is None and _frozen(procs[frozen].pid):
                froze_at = time.monotonic()
            ended.update({r: time.monotonic() for r, p in enumerate(procs)
                          if r != frozen and r not in ended and p.poll() is not None})
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    assert froze_at is not None, f"rank {frozen} never froze: {(tmp / f'r{frozen}.err').read_text()}"
    ranks = []
    for r, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        ranks.append(Rank(p.returncode, out.read(), err.read(), ended.get(r, float("inf")) - froze_at))
        out.close()
        err.close()
    return ranks


@pytest.mark.parametrize("frozen", [3, 0])
def test_a_frozen_rank_ends_every_other_rank_within_the_deadline_naming_it(tmp_path, frozen):
    """pp=2 x dp=2, rank 3 or rank 0 frozen whole by SIGSTOP before iteration 3: its watchdog and beats stop with
    it, and rank 0 hosts the rendezvous store, so then every store call of the others blocks for good. Every
    other rank exits within --timeout-s + the watchdog's margin (+ 3 s for a loaded machine) of the freeze, its one
    line naming the frozen rank: from the beats (rank 3), or as the store's host that does not answer (rank 0)."""
    deadline_s = 6
    ranks = spawn_with_a_frozen_rank(4, ["--dp", "2", "--iters", "100", "--timeout-s", str(deadline_s)], tmp_path,
                                     f"stop:rank={frozen}:iter=3", frozen, limit_s=STARTUP_S + 60)
    assert f"rank {frozen} (stage {frozen % 2}) stops (SIGSTOP) before iteration 3" in ranks[frozen].err
    for i, r in enumerate(ranks):
        if i == frozen:
            continue
        assert r.rc not in (0, None) and len(r.errors()) == 1 and "Traceback" not in r.err, (i, r.err)
        assert r.seconds <= deadline_s + 1.0 + EXIT_MARGIN_S + 3.0, (i, r.seconds, r.err)
        line = r.errors()[0]
        if frozen == 3:
            assert "; rank 3 (stage 1, replica 1) (last seen in iteration " in line, line
            assert "stopped responding" in line, line
        else:
            assert "the rendezvous store at 127.0.0.1:" in line and ", hosted by rank 0 (stage 0) has not answered "\
                "for " in line, line
            assert "last seen: " in line, line
