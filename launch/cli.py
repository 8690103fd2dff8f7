"""The command line of launch/pipeline.py, generated from RunConfig's fields: one flag per field.

Each field's `Flag` (distributed/config.py) gives the group, help, choices, alias and metavar; the argument's type
comes from the field's annotation and its default from the field (or from the documented environment override the
Flag names). argparse, not a library such as tyro: no dependency to ship to the GPU images. A bad flag or value
is one `peerline: error: <argparse's message> (see --help)` line, like RunConfig's checks, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any

from peerline import overrides
from peerline.distributed.config import GROUPS, OUTPUT, ConfigError, Flag, RunConfig, flag_name, flags
from peerline.distributed.config_file import ConfigFileParser
from peerline.launch.messages import report_error

DESCRIPTION = ("Train a pipelined model across GPUs (pp stages x dp replicas) and report loss and speed. "
               "Start with torchrun (--nproc_per_node=N), srun, mpirun, or plainly for one GPU / the CPU.")
EXAMPLES = ("examples:\n"
            "  torchrun --nproc_per_node=2 launch/pipeline.py                 two stages, one per GPU\n"
            "  torchrun --nproc_per_node=4 launch/pipeline.py --pp 2 --dp 2   2 stages x 2 replicas\n"
            "  python launch/pipeline.py --stages 4                           4 stages on one GPU\n"
            "  PEERLINE_DEVICE=cpu torchrun --nproc_per_node=2 launch/pipeline.py   the CPU, gloo")


def build_parser() -> argparse.ArgumentParser:
    """The parser: RunConfig's fields by group, then the action flags that are no part of the run's config."""
    p = Parser(prog=program_name(), description=DESCRIPTION,  # with --config, --print-config
               epilog=EXAMPLES + "\n\n" + overrides.describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    types = typing.get_type_hints(RunConfig)
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for group_name, group in groups.items():
        for f, flag in flags():
            if flag.group == group_name:
                _add_flag(group, f, flag, types[f.name])
        if group_name == OUTPUT:
            group.add_argument("--print-schedule", action="store_true", help="print the schedule as a table and exit")
    return p


class Parser(ConfigFileParser):
    """The main job's parser: a bad flag or value is one `peerline: error:` line, shown once per job, exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        report_error(f"{message} (see --help)")
        sys.exit(2)


def program_name(argv0: str | None = None) -> str:
    """The name `usage:` shows: the console script's name (peerline-pipeline), or the script's path as typed
    (launch/pipeline.py); an absolute path (python -m) shows as the module."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if not argv0.endswith(".py"):
        return os.path.basename(argv0) or "peerline-pipeline"
    return "python -m peerline.launch.pipeline" if os.path.isabs(argv0) else argv0


def _add_flag(group: Any, f: dataclasses.Field, flag: Flag, annotation: Any) -> None:
    """One field's argument: --x/--no-x (or a plain switch) for a bool, else a typed value."""
    names = [flag_name(f.name), *([flag.short] if flag.short else [])]
    default = (overrides.get(flag.env) if flag.env else None) or f.default
    kind = _value_type(annotation)
    if kind is bool:
        action = "store_true" if flag.switch else argparse.BooleanOptionalAction
        group.add_argument(*names, action=action, default=default, help=flag.help)
        return
    extra = {"metavar": flag.metavar} if flag.metavar else {}
    group.add_argument(*names, type=kind, choices=flag.choices, default=default, help=flag.help, **extra)


def _value_type(annotation: Any) -> type:
    """int for `int | None`, and so on: the annotation without None."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(kinds) != 1:
        raise TypeError(f"a RunConfig field needs one value type, got {annotation}")
    return kinds[0]


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Map parsed flags onto RunConfig (its __post_init__ raises ConfigError on bad values)."""
    try:
        overrides.log_level()  # the environment's one setting of the job that is no flag: checked with the flags
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(args).items() if k in names})


__all__ = ["build_parser", "config_from_args", "program_name", "Parser", "ConfigError"]
