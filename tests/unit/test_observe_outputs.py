"""What a run writes where people look, on the CPU: the start-up check of output paths, the --json record's
resolved config, final loss, version and commit, the per-iteration JSONL stream, TensorBoard event files, the
torch.profiler trace with the engine's step labels, and --config / --print-config (distributed/config_file.py)."""

from __future__ import annotations

import glob
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.config_file import dump_config, load_config_file
from peerline.distributed.hooks import IterationStats
from peerline.distributed.observe import record, tensorboard
from peerline.distributed.observe.metrics_jsonl import MetricsJsonl, iteration_metrics
from peerline.distributed.observe.profiler import StepRanges, profile_window
from peerline.distributed.pipeline.engine import no_range_pop, no_range_push
from peerline.launch.cli import build_parser, config_from_args
from tests.helpers import PIPELINE, cpu_env, run_command

pytestmark = pytest.mark.timeout(120)
TINY = ["--hidden", "16", "--layers", "2", "--seq", "8", "--micro-batch-size", "2", "--device", "cpu"]


def _fake_rt(tmp_path: Path, rank: int = 0, resume: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(rank=rank), device=torch.device("cpu"),
                           cfg=SimpleNamespace(resume=resume))


def _stats(iteration: int, loss: float) -> IterationStats:
    return IterationStats(iteration, loss, 12.5, 1000.0, 0.0, tflops=0.5, mfu=None)


# -- start-up checks ---------------------------------------------------------------------------------------------

def test_outputs_that_cannot_be_written_are_one_line_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--json .*: the folder .*missing does not exist$"):
        record.check_outputs(RunConfig(json=str(tmp_path / "missing" / "r.json")))
    with pytest.raises(ConfigError, match=r"^--json .* is a folder: give a file name$"):
        record.check_outputs(RunConfig(json=str(tmp_path)))
    with pytest.raises(ConfigError, match="^--timeline .*: the folder .* does not exist$"):
        record.check_outputs(RunConfig(timeline=str(tmp_path / "no" / "tl")))
    with pytest.raises(ConfigError, match="^--metrics-jsonl .* is a folder"):
        record.check_outputs(RunConfig(metrics_jsonl=str(tmp_path)))
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="^--profile .*afile is a file, not a folder$"):
        record.check_outputs(RunConfig(profile=str(tmp_path / "afile" / "sub")))
    # Writable outputs pass; folders that do not exist yet are made by their writers.
    record.check_outputs(RunConfig(json=str(tmp_path / "r.json"), timeline=str(tmp_path / "tl"),
                                   metrics_jsonl=str(tmp_path / "m.jsonl"), profile=str(tmp_path / "p" / "q")))


def test_missing_tensorboard_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^--tensorboard needs the tensorboard package: pip install "
                                          r"'peerline\[tensorboard\]'"):
        record.check_outputs(RunConfig(tensorboard=str(tmp_path / "tb")))


# -- the record --------------------------------------------------------------------------------------------------

def test_git_commit_of_the_checkout_and_none_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    commit = record.git_commit()
    if (Path(record.__file__).resolve().parents[2] / ".git").exists():
        assert commit is not None and len(commit) == 40 and int(commit, 16) >= 0

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(record.subprocess, "run", no_git)
    assert record.git_commit() is None


# -- metrics -----------------------------------------------------------------------------------------------------

def test_metrics_are_null_where_they_do_not_apply() -> None:
    m = iteration_metrics(_stats(3, float("nan")), on_gpu=False)
    assert m == {"loss": None, "ms_per_iter": 12.5, "tokens_per_s": 1000.0, "tflops": 0.5, "mfu": None,
                 "peak_mem_gb": None}
    assert iteration_metrics(_stats(3, 1.5), on_gpu=True)["peak_mem_gb"] == 0.0


def test_metrics_jsonl_flushes_each_line_on_rank_0_and_appends_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    hook = MetricsJsonl(str(path))
    hook.on_train_start(_fake_rt(tmp_path))
    hook.on_logged(None, _stats(1, 2.0))
    hook.on_logged(None, _stats(2, float("inf")))
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]  # before close: flushed
    assert [(d["iteration"], d["loss"]) for d in lines] == [(1, 2.0), (2, None)]
    hook.on_train_end(None)
    resumed = MetricsJsonl(str(path))
    resumed.on_train_start(_fake_rt(tmp_path, resume="ck"))
    resumed.on_logged(None, _stats(3, 1.0))
    resumed.on_train_end(None)
    assert len(path.read_text().splitlines()) == 3
    other = MetricsJsonl(str(tmp_path / "rank1.jsonl"))
    other.on_train_start(_fake_rt(tmp_path, rank=1))
    other.on_logged(None, _stats(1, 2.0))
    assert not (tmp_path / "rank1.jsonl").exists()


def test_tensorboard_writes_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hook = tensorboard.TensorBoardWriter(str(tmp_path / "tb"))
    hook.on_train_start(_fake_rt(tmp_path))
    for i in (1, 2):
        hook.on_logged(None, _stats(i, 3.0 - i))
    hook.on_train_end(None)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/ms_per_iter", "train/tokens_per_s",
                                              "train/tflops"}
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0), (2, 1.0)]


# -- profiles and ranges -----------------------------------------------------------------------------------------

def test_profile_window_traces_three_after_warm_up_or_what_there_is() -> None:
    assert profile_window(5) == (1, 1, 3)
    assert profile_window(100) == (1, 1, 3)
    assert profile_window(4) == (0, 1, 3)
    assert profile_window(2) == (0, 0, 2)
    assert profile_window(1) == (0, 0, 1)


def test_step_ranges_are_no_ops_unless_asked() -> None:
    engine = SimpleNamespace(set_ranges=lambda push, pop: setattr(engine, "marks", (push, pop)))
    rt = SimpleNamespace(device=torch.device("cpu"), engine=engine)
    StepRanges(labels=False).on_train_start(rt)  # --nvtx on the CPU: nothing to mark
    assert not hasattr(engine, "marks")
    StepRanges(labels=True).on_train_start(rt)
    push, pop = engine.marks
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        push("stage0 F0")
        torch.ones(2).sum()
        pop()
    assert "stage0 F0" in {e.name for e in prof.events()}
    assert no_range_push("x") is None and no_range_pop() is None


# -- --config / --print-config -----------------------------------------------------------------------------------

def test_config_file_round_trip_and_flags_win(tmp_path: Path) -> None:
    cfg = RunConfig(pp=2, dp=2, schedule="gpipe", hidden=32, lr=0.5, graph=False, json="r.json", nvtx=True,
                    timeout_s=60.0, tensorboard="tb")
    path = tmp_path / "run.toml"
    path.write_text(dump_config(cfg))
    assert RunConfig(**load_config_file(str(path))) == cfg
    parsed = config_from_args(build_parser().parse_args(["--config", str(path), "--hidden", "64"]))
    assert parsed.hidden == 64 and parsed.schedule == "gpipe" and parsed.pp == 2 and parsed.nvtx
    (tmp_path / "dash.toml").write_text("micro-batch-size = 3\nbucket_mb = 4\n")
    assert load_config_file(str(tmp_path / "dash.toml")) == {"micro_batch_size": 3, "bucket_mb": 4.0}


def test_a_flag_wins_over_the_file_field_that_would_set_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("global_batch = 16\nmicrobatches = 4\n")

    def parse(*flags: str) -> RunConfig:
        return config_from_args(build_parser().parse_args(["--config", str(path), *flags]))

    assert (parse().micro_batch_size, parse().global_batch) == (4, 16)  # the file alone: 16 / 4
    for flag in (["--micro-batch-size", "2"], ["--micro-batch-size=2"], ["--micro-batch", "2"]):
        cfg = parse(*flag)
        assert (cfg.micro_batch_size, cfg.global_batch, cfg.microbatches) == (2, None, 4), flag
    cfg = parse("--global-batch", "32", "--micro-batch-size", "8")  # both given, and they agree
    assert (cfg.micro_batch_size, cfg.global_batch) == (8, 32)
    with pytest.raises(ConfigError, match=r"^--global-batch 16 sets the micro-batch size to 16 / \(dp x microbatches "
                                          r"= 4\) = 4, not --micro-batch-size 2: give one of the two$"):
        build_parser().parse_args(["--global-batch", "16", "-m", "4", "--micro-batch-size", "2"])
    assert "(--micro-batch-size over the file's global_batch)" in " ".join(build_parser().format_help().split())


@pytest.mark.parametrize(("text", "message"), [
    ("hiden = 3\n", r"^unknown key 'hiden' in .*bad.toml \("),
    ("iters = \"3\"\n", r"^key 'iters' in .*bad.toml must be int, got str '3'$"),
    ("graph = 1\n", r"^key 'graph' in .*bad.toml must be bool, got int 1$"),
    ("iters = \n", r"^--config .*bad.toml is not valid TOML: "),
])
def test_bad_config_file_is_one_line_naming_key_and_file(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_parser().parse_args(["--config", str(tmp_path / "bad.toml")])
    with pytest.raises(ConfigError, match="cannot read it"):
        build_parser().parse_args(["--config", str(tmp_path / "none.toml")])


def test_print_config_prints_toml_and_exits_0(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--print-config", "--iters", "7", "--pp", "1"])
    assert e.value.code == 0
    import tomllib

    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["iters"] == 7 and printed["pp"] == 1 and printed["log_every"] == 1 and "json" not in printed


# -- one run, every output ---------------------------------------------------------------------------------------

def test_a_run_writes_record_metrics_events_and_profile(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run = subprocess.run([sys.executable, PIPELINE, *TINY, "--iters", "4", "--json", "r.json", "--metrics-jsonl",
                          "m.jsonl", "--tensorboard", "tb", "--profile", "prof"], cwd=tmp_path, env=cpu_env(),
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    assert {k: rec["config"][k] for k in ("pp", "dtype", "graph", "kernels")} == {
        "pp": 1, "dtype": "fp32", "graph": False, "kernels": "torch"}
    assert math.isfinite(rec["final_loss"]) and rec["final_loss"] == rec["losses"][-1]
    assert rec["peerline_version"] and "git_commit" in rec
    assert [json.loads(ln)["iteration"] for ln in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    (trace,) = glob.glob(str(tmp_path / "prof" / "rank0" / "rank0.*.pt.trace.json"))
    names = {e["name"] for e in json.loads(Path(trace).read_text())["traceEvents"]}
    assert {"stage0 F0", "stage0 B3", "optimizer"} <= names
    assert "profiling iterations 2-4 (eager)" in run.stdout
    assert "USDT:" not in run.stderr and "STAGE:" not in run.stderr, run.stderr  # torch.profiler's own lines


def test_profile_lines_are_peerline_s_alone(tmp_path: Path) -> None:
    """torch.profiler's USDT / STAGE lines (kineto's log) do not mix with the run's: KINETO_LOG_LEVEL=6 unless set."""
    env = {k: v for k, v in cpu_env().items() if k != "KINETO_LOG_LEVEL"}
    run = subprocess.run([sys.executable, PIPELINE, *TINY, "--iters", "4", "--profile", "prof"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert glob.glob(str(tmp_path / "prof" / "rank0" / "rank0.*.pt.trace.json"))
    assert "USDT:" not in run.stderr and "STAGE:" not in run.stderr, run.stderr


def test_unwritable_json_fails_before_training(tmp_path: Path) -> None:
    run = run_command([sys.executable, PIPELINE, *TINY, "--json", "nowhere/r.json"], tmp_path, timeout=100)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == \
        "peerline: error: --json nowhere/r.json: the folder nowhere does not exist"
    assert "iter 1" not in run.stdout
