"""One configuration tree: RunConfig's fields make the command line, --help, the JSON record and the checks; the
choice lists are defined once; the environment is read only through peerline/overrides.py."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peerline import choices, overrides
from peerline.distributed.config import GROUPS, ConfigError, RunConfig, flag_name, flags
from peerline.launch.cli import build_parser, config_from_args

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("distributed", "kernels", "launch", "peerline")
CLI_ONLY = {"help", "print_schedule", "config", "print_config"}  # action flags: no part of the run's configuration
# Every field set away from its default (bools flipped, a global batch that divides).
SAMPLE = RunConfig(
    pp=2, dp=2, stages=2, schedule="gpipe", microbatches=4, global_batch=24, seq=16, hidden=32, layers=2,
    model="pkg.mod:make", seed=7, iters=9, lr=0.01, device="cpu", dtype="fp32", kernels="torch", p2p="nccl",
    p2p_lanes=4, p2p_split=True, p2p_decoupled=False, graph=False, warmup_iters=2, graph_loop=2,
    grad_sync="per-param", bucket_mb=4.0, first_bucket_mb=0.5, nccl_max_ctas=8, allreduce_priority="normal",
    timeout_s=60.0, log_every=4, json="run.json", timeline="tl", data="counter", staging="direct",
    allocator="async", pool_release_threshold=0, save="ck", save_every=2, resume="ck0", skip_nonfinite=True)


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for o in overrides.OVERRIDES:
        monkeypatch.delenv(o.name, raising=False)


def _actions() -> dict[str, object]:
    return {a.dest: a for a in build_parser()._actions}


def _argv(cfg: RunConfig) -> list[str]:
    """The command line that asks for `cfg`, from the fields alone."""
    argv: list[str] = []
    for f, flag in flags():
        value = getattr(cfg, f.name)
        if value is None or (flag.switch and value is False):
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            argv += [flag_name(f.name), str(value)]
    return argv


def _parse(argv: list[str]) -> RunConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_every_field_has_exactly_one_flag() -> None:
    actions = _actions()
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    assert set(actions) - CLI_ONLY == fields
    for f, flag in flags():
        a = actions[f.name]
        assert a.option_strings[0] == flag_name(f.name) and flag.group in GROUPS and flag.help
        assert a.default == f.default  # no override set: the field's own default
        assert a.choices == flag.choices
    assert actions["microbatches"].option_strings == ["--microbatches", "-m"]


def test_help_shows_every_flag_with_its_default_in_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    text = build_parser().format_help()
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert [t for t in titles if t in GROUPS] == list(GROUPS)
    entries: dict[str, str] = {}
    for line in text.split("\n\n", 1)[1].splitlines():  # a flag's help may start on the line after it
        if line.startswith("  --"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif line.startswith("   ") and entries:
            entries[flag] += line
    worded = {"save_every": "only at the end"}  # a default said in words
    for f, _flag in flags():
        entry = entries[flag_name(f.name)]
        if f.default is None or f.default is False:
            continue
        shown = entry[entry.index("default"):]
        assert worded.get(f.name, str(f.default)) in shown, entry
    assert "PEERLINE_DEVICE" in text and "--print-schedule" in text


def test_parse_config_record_round_trip() -> None:
    assert _parse([]).to_dict() == RunConfig().to_dict()
    record = _parse(_argv(SAMPLE)).to_dict()
    assert record == SAMPLE.to_dict() and record["micro_batch_size"] == 3  # 24 / (dp 2 x M 4)
    assert json.loads(json.dumps(record)) == record  # what --json writes
    assert RunConfig(**record) == SAMPLE


def test_log_every_follows_the_graph_loop_unless_given() -> None:
    assert RunConfig().log_every == 1 and RunConfig(graph_loop=4).log_every == 4
    assert _parse(["--graph-loop", "4", "--log-every", "8"]).log_every == 8
    with pytest.raises(ConfigError, match="--log-every must be a multiple"):
        _parse(["--graph-loop", "4", "--log-every", "2"])


def test_bad_choice_is_an_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--schedule", "zigzag"])
    assert e.value.code == 2
    assert "argument --schedule: invalid choice: 'zigzag'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        RunConfig(schedule="zigzag")


def test_bad_value_is_one_error_line_exit_2() -> None:
    run = subprocess.run([sys.executable, str(REPO / "launch" / "pipeline.py"), "--microbatches", "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["peerline: error: --microbatches must be >= 1, got 0"]


def test_config_is_frozen_and_replace_checks_again() -> None:
    cfg = RunConfig(global_batch=16, dp=2, microbatches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 3
    assert dataclasses.replace(cfg, microbatches=2).micro_batch_size == 4
    with pytest.raises(ConfigError, match="--microbatches must be >= 1"):
        dataclasses.replace(cfg, microbatches=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"save_every": -1}, "--save-every must be >= 0, got -1"),
    ({"save_every": 2}, "--save-every needs --save DIR"),
])
def test_failure_fields_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kwargs)


def test_environment_overrides_only_the_command_line_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLINE_DEVICE", "cpu")
    monkeypatch.setenv("PEERLINE_ALLOCATOR", "async")
    cfg = _parse([])
    assert (cfg.device, cfg.allocator) == ("cpu", "async")
    assert _parse(["--device", "auto"]).device == "auto"
    assert (RunConfig().device, RunConfig().allocator) == ("auto", None)
    monkeypatch.setenv("PEERLINE_DEVICE", "")  # empty: unset
    assert _parse([]).device == "auto"


def _product_files() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_choice_lists_are_defined_once() -> None:
    lists = {v for k, v in vars(choices).items() if k.isupper() and isinstance(v, tuple)}
    found = []
    for path in [*_product_files(), *sorted((REPO / "bench").rglob("*.py"))]:
        if path == REPO / "peerline" / "choices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
                if tuple(e.value for e in node.elts) in lists:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"choice lists repeated instead of imported from peerline.choices: {found}"


def test_environment_is_read_only_through_overrides() -> None:
    raw = re.compile(r"\bos\.environ\b|\bgetenv\b|\bputenv\b|\bfrom os import\b")
    where = [f"{p.relative_to(REPO)}:{n}" for p in _product_files() if p != REPO / "peerline" / "overrides.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert not where, f"environment read outside peerline/overrides.py: {where}"


def test_overrides_describe_every_variable_the_product_names() -> None:
    text = overrides.describe()
    named = set()
    call = re.compile(r"overrides\.\w+\(\s*\"([A-Z0-9_]+)\"")
    for path in _product_files():
        source = path.read_text()
        named |= set(re.findall(r"\bPEERLINE_[A-Z0-9_]+\b", source)) | set(call.findall(source))
    assert named, "no variable found: the scan is broken"
    missing = sorted(n for n in named | set(overrides.LAUNCH_VARIABLES) if n not in text)
    assert not missing, f"not in peerline/overrides.py's table: {missing}"
    for o in overrides.OVERRIDES:
        assert o.name in text and o.meaning in text


def test_overrides_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERLINE_P2P_SPLIT_MIN", "4096")
    assert overrides.get_int("PEERLINE_P2P_SPLIT_MIN", 1) == 4096 and overrides.get("PEERLINE_FAULT") is None
    monkeypatch.setenv("PEERLINE_P2P_SPLIT_MIN", "")
    assert overrides.get_int("PEERLINE_P2P_SPLIT_MIN", 1) == 1
    monkeypatch.setenv("PEERLINE_KERNEL_WARPS", "many")
    with pytest.raises(ValueError, match="PEERLINE_KERNEL_WARPS='many' is not an integer"):
        overrides.get_int("PEERLINE_KERNEL_WARPS", 8)
    with pytest.raises(KeyError, match="not a documented"):
        overrides.get("HOME")
    monkeypatch.setenv("RANK", "3")
    assert overrides.environment()["RANK"] == "3"
    with pytest.raises(TypeError):
        overrides.environment()["RANK"] = "4"  # read-only: writes go through set_default / assign


def test_overrides_table_shows_the_code_defaults() -> None:
    from peerline.distributed import streams
    from peerline.kernels import compile as kc
    from peerline.kernels import plan

    shown = {o.name: o.default for o in overrides.OVERRIDES}
    assert shown["PEERLINE_KERNEL_WARPS"] == str(plan.DEFAULT_WARPS)
    assert shown["PEERLINE_KERNEL_STAGES"] == str(plan.DEFAULT_STAGES)
    assert shown["PEERLINE_KERNEL_GELU"] == str(kc.GELU_FAST)
    assert shown["CUDA_DEVICE_MAX_CONNECTIONS"] == str(streams.HARDWARE_QUEUES)
    assert shown["PEERLINE_DEVICE"] == RunConfig().device


@pytest.mark.parametrize("argv,message", [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--timeout-s", "nan"], "--timeout-s must be a finite number, got nan"),
    (["--timeout-s", "1e300"], "--timeout-s must be <= 604800, got 1e+300"),
    (["--bucket-mb", "nan"], "--bucket-mb must be a finite number, got nan"),
    (["--first-bucket-mb", "inf"], "--first-bucket-mb must be a finite number, got inf"),
    (["--seed", str(10**30)], f"--seed must be <= 4294967295, got {10**30}"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--hidden", str(10**12)], f"--hidden must be <= 2147483647, got {10**12}"),
    (["--global-batch", "-8"], "--global-batch must be >= 1, got -8"),
    (["--global-batch", "0"], "--global-batch must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be positive"),
])
def test_numbers_out_of_range_or_not_finite_are_one_line(argv, message):
    """NaN passes every `<= 0` test: every numeric flag is checked for finiteness and its range at parse time."""
    from peerline.launch.cli import build_parser, config_from_args

    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser().parse_args(argv))
    assert str(info.value) == message or str(info.value).startswith(message)


def test_bogus_log_level_is_one_line(monkeypatch):
    from peerline.launch.cli import build_parser, config_from_args

    monkeypatch.setenv("PEERLINE_LOG", "BOGUS")
    with pytest.raises(ConfigError, match="PEERLINE_LOG='BOGUS' is not a logging level; choose one of DEBUG"):
        config_from_args(build_parser().parse_args([]))
    monkeypatch.setenv("PEERLINE_LOG", "info")
    config_from_args(build_parser().parse_args([]))


def test_shard_optimizer_keeps_the_precision_given():
    """master shards with bf16 compute too (ShardedMasterAdamW): --shard-optimizer changes no recipe."""
    assert _parse(["--dp", "2", "--shard-optimizer", "--dtype", "bf16"]).precision == "master"
    assert _parse(["--dp", "2", "--shard-optimizer", "--dtype", "bf16", "--precision", "autocast"]).precision == \
        "autocast"
    with pytest.raises(ConfigError, match="--precision compact does not support --shard-optimizer"):
        _parse(["--dp", "2", "--shard-optimizer", "--dtype", "bf16", "--precision", "compact"])
