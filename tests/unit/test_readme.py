"""The README and docs/ stay true to the code: the flag tables are `--help`'s, the set-up commands come first, the
extras and links exist, and the model contract names every keyword a factory can take.

Regenerate the flag tables after changing a flag: python tests/unit/test_readme.py
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from peerline.distributed.config import RunConfig
from peerline.distributed.model import run_values
from peerline.launch.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TUNING = REPO / "docs" / "TUNING.md"
USAGE = REPO / "docs" / "USAGE.md"
#: execution flags documented in docs/TUNING.md instead of the README (by argparse dest)
TUNING_FLAGS = ("p2p_lanes", "p2p_split", "p2p_decoupled", "warmup_iters", "graph_loop", "grad_sync", "bucket_mb",
                "first_bucket_mb", "nccl_max_ctas", "allreduce_priority", "timeout_s", "staging", "allocator",
                "pool_release_threshold")
BEGIN = "<!-- flag tables: generated from --help by tests/unit/test_readme.py (python tests/unit/test_readme.py) -->"
END = "<!-- end of flag tables -->"


def _flag_cell(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    shorts = [s for s in action.option_strings if not s.startswith("--")]
    if action.nargs != 0:
        value = "|".join(action.choices) if action.choices else (action.metavar or action.dest.upper())
        value = value.replace("|", "\\|")  # a bare | would end the table cell
        longs = [f"{s} {value}" for s in longs]
    return ", ".join(f"`{s}`" for s in longs + shorts)


def flag_tables(tuning: bool) -> str:
    """Markdown tables of the parser's flags, one per --help group: the README's (tuning=False) or TUNING.md's."""
    formatter = argparse.HelpFormatter("pipeline")
    parts = []
    for group in build_parser()._action_groups:
        rows = []
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help" or (action.dest in TUNING_FLAGS) != tuning:
                continue
            text = " ".join(formatter._expand_help(action).split()) if action.help else ""
            rows.append(f"| {_flag_cell(action)} | {text.replace('|', chr(92) + '|')} |")
        if rows:
            title = "general" if group.title in ("options", "optional arguments") else group.title
            parts.append(f"**{title}**\n\n| flag | meaning |\n| --- | --- |\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _block(text: str) -> str:
    assert BEGIN in text and END in text, "the flag tables' markers are missing"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def regenerate(path: Path, tuning: bool) -> None:
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n\n{flag_tables(tuning)}\n\n{END}{rest.split(END, 1)[1]}")


@pytest.mark.parametrize("path,tuning", [(README, False), (TUNING, True)], ids=["README", "TUNING"])
def test_flag_tables_are_the_help(path: Path, tuning: bool) -> None:
    assert _block(path.read_text()) == flag_tables(tuning), \
        f"{path.name}'s flag tables differ from --help: run python tests/unit/test_readme.py"


def test_every_flag_is_documented_once() -> None:
    documented = _block(README.read_text()) + _block(TUNING.read_text())
    for action in build_parser()._actions:
        for flag in (s for s in action.option_strings if s.startswith("--") and s != "--help"):
            assert len(re.findall(rf"`{re.escape(flag)}[` ]", documented)) == 1, flag


def test_set_up_commands_come_first_cpu_torch_before_install() -> None:
    text = README.read_text()
    first = text.index("## Set-up")
    assert first < text.index("## Launchers") and first < text.index("## Bringing your own model")
    torch_note = text.index("    pip install torch==", first)
    install = text.index("    pip install -e . && torchrun --nproc_per_node=2 launch/pipeline.py", first)
    tests = text.index("    bash tools/test.sh", first)
    assert torch_note < install < tests < text.index("## Installing on a GPU machine")


def test_set_up_heading_counts_its_commands() -> None:
    text = README.read_text()
    start = text.index("## Set-up: ")
    section = text[start:text.index("\n## ", start + 1)]
    words = {"one": 1, "two": 2, "three": 3, "four": 4}
    said = words[section.split()[2]]
    commands = [ln for ln in section.splitlines() if ln.startswith("    ") and ln.strip()]
    assert said == len(commands), (section.splitlines()[0], commands)


def test_usage_lists_every_benchmark_suite() -> None:
    from peerline.bench import suites

    text = " ".join(USAGE.read_text().split())
    listed = text[text.index("Suites ("):].split(": ", 1)[1].split(".", 1)[0]
    assert [name.strip() for name in listed.split(",")] == list(suites.SUITES)


def test_named_extras_exist() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for path in (README, TUNING, USAGE):
        for name in re.findall(r"\.\[([a-z0-9_-]+)\]", path.read_text()):
            assert name in extras, f"{path.name} names the extra [{name}], which pyproject.toml lacks"


def test_relative_links_resolve() -> None:
    for path in (README, TUNING, USAGE):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


def test_model_contract_names_every_factory_keyword() -> None:
    text = README.read_text()
    start = text.index("- It may take keyword arguments", text.index("## Bringing your own model"))
    bullet = text[start:text.index("\n- ", start)]
    for name in run_values(RunConfig(), vocab=4096):
        assert f"`{name}`" in bullet, f"the README's model contract does not name the factory keyword {name!r}"


def test_slurm_docs_say_where_the_checkout_lives_and_what_to_pass() -> None:
    """The scripts run the checkout and its virtualenv from every node by the submitting shell's paths, and their
    defaults (8 GPUs, 16 CPUs per node, no partition or account) fit few clusters as they are."""
    guide = (REPO / "slurm" / "README.md").read_text()
    before = " ".join(guide[guide.index("## Before you submit"):guide.index("| script | tasks |")].split())
    assert "filesystem that every node mounts at the same path" in before and "virtualenv" in before
    assert "-p PARTITION -A ACCOUNT" in before and "--gpus-per-node=N" in before
    for script in ("pipeline.sbatch", "multinode.sbatch", "mpi.sbatch"):
        head = " ".join((REPO / "slurm" / script).read_text().split("#SBATCH", 1)[0].replace("#", " ").split())
        assert "every node sees at the same path" in head and "-p gpu -A myproj --gpus-per-node=" in head, script
    slurm_row = next(ln for ln in README.read_text().splitlines() if ln.startswith("| Slurm |"))
    assert "every node sees at the same path" in slurm_row and "--gpus-per-node" in slurm_row


if __name__ == "__main__":
    regenerate(README, tuning=False)
    regenerate(TUNING, tuning=True)
    sys.exit(0)
