"""`--config FILE` (TOML) and `--print-config`: the run's configuration as a file.

The file holds RunConfig's fields by name, flat, as --print-config writes them (`micro_batch_size = 4` or
`micro-batch-size = 4`); a field left out keeps its default. Flags given on the command line win over the file,
and the file wins over the defaults (and the environment overrides of defaults). A flag also wins over a file's
field that would set it (DERIVES: `--micro-batch-size 2` drops the file's `global_batch = 16`, which sets the
micro-batch size), and two flags that set one field differently are one ConfigError line. An unknown key, a value
of the wrong type or a file that is not TOML is one ConfigError line naming the key and the file.

`ConfigFileParser` is the argparse parser that does this: it reads --config before parsing and sets the file's
values as the defaults, and after parsing prints the resolved configuration for --print-config and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from collections.abc import Sequence
from typing import Any

from peerline import overrides
from peerline.distributed.config import ConfigError, RunConfig, flag_name, flags

#: RunConfig fields that set others when given (config.py `_derive_batch`): deriving field -> the fields it sets.
DERIVES: dict[str, tuple[str, ...]] = {"global_batch": ("micro_batch_size",)}


def load_config_file(path: str) -> dict[str, Any]:
    """The fields a TOML file sets, checked by name and type (see the module docstring)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("--config needs Python 3.11 (tomllib) or the tomli package") from None
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path} is not valid TOML: {exc}") from None
    types = typing.get_type_hints(RunConfig)
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(f"unknown key {key!r} in {path} (the keys are the run's fields, as --print-config "
                              "shows them)")
        values[name] = _checked(name, value, types[name], path)
    return values


def _checked(name: str, value: Any, annotation: Any, path: str) -> Any:
    """`value` if it fits the field's type (an int where a float is wanted becomes a float)."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = kinds[0]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(f"key {name!r} in {path} must be {kind.__name__}, got {type(value).__name__} {value!r}")


def dump_config(cfg: RunConfig) -> str:
    """The configuration as TOML that `load_config_file` reads back to the same RunConfig; a field without a
    value (None: its default is resolved at run time, e.g. pp from the world) is a comment."""
    lines = []
    for f, _flag in flags():
        value = getattr(cfg, f.name)
        if value is None:
            lines.append(f"# {f.name}: not set ({flag_name(f.name)} takes its default)")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


class ConfigFileParser(argparse.ArgumentParser):
    """An ArgumentParser with --config FILE and --print-config (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--config", metavar="FILE", help="read the run's settings from a TOML file (the fields "
                          "by name, as --print-config shows them); flags given here win, also over a field of the "
                          "file that would set them (--micro-batch-size over the file's global_batch)")
        self.add_argument("--print-config", action="store_true",
                          help="print the resolved configuration as TOML (for --config) and exit")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        argv = sys.argv[1:] if args is None else list(args)
        given, _ = pre.parse_known_args(argv)
        from_file = load_config_file(given.config) if given.config else {}
        self.set_defaults(**from_file)
        parsed, extra = super().parse_known_args(args, namespace)
        flags_win(parsed, from_file, self.given_on_command_line(argv))
        if getattr(parsed, "print_config", False):
            names = {f.name for f in dataclasses.fields(RunConfig)}
            cfg = RunConfig(**{k: v for k, v in vars(parsed).items() if k in names})
            if overrides.get_int("RANK", overrides.get_int("SLURM_PROCID", 0)) == 0:
                print(dump_config(cfg), end="", flush=True)
            self.exit(0)
        return parsed, extra

    def given_on_command_line(self, argv: list[str]) -> set[str]:
        """The destinations of the flags `argv` gives (abbreviated or not): those a parse into a namespace that
        holds a marker for every destination sets."""
        marker = object()
        probe = argparse.Namespace(**{a.dest: marker for a in self._actions if a.dest != argparse.SUPPRESS})
        parsed, _ = super().parse_known_args(argv, probe)
        return {k for k, v in vars(parsed).items() if v is not marker}


def flags_win(parsed: argparse.Namespace, from_file: dict[str, Any], given: set[str]) -> None:
    """A field the file derives another from is dropped when the command line gives that other field (and not the
    deriving one); two flags that set one field differently are one ConfigError line."""
    for field, derived in DERIVES.items():
        if field in from_file and field not in given and any(d in given for d in derived):
            setattr(parsed, field, None)
    if {"global_batch", "micro_batch_size"} <= given and parsed.global_batch is not None:
        per = parsed.dp * parsed.microbatches
        if per > 0 and parsed.global_batch % per == 0 and parsed.global_batch // per != parsed.micro_batch_size:
            raise ConfigError(f"--global-batch {parsed.global_batch} sets the micro-batch size to "
                              f"{parsed.global_batch} / (dp x microbatches = {per}) = {parsed.global_batch // per}, "
                              f"not --micro-batch-size {parsed.micro_batch_size}: give one of the two")
