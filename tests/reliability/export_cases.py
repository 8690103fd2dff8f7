"""export_checkpoint's bad inputs for the reliability suite (loaded by tests/reliability/cases.py): `cases(workdir)`
returns one `Case` per input, each `python -m peerline.launch.export_checkpoint DIR --to FILE`, forked from the test
fork server (tests/forkjob.py: the exporter's own checks are the subject, not a fresh interpreter's start-up).

Built once here: a checkpoint folder of a one-process run saving at 2 and 4. A bad DIR, a checkpoint that does not
verify, a --to that cannot be written or has an unknown suffix, a missing flag: one `peerline: error:` line naming
the problem, exit 2, and the checkpoint byte for byte as it was. A --to that is a character device (a link to
/dev/null) or a FIFO is written into and stays what it was.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from tests.helpers import PIPELINE, cpu_env, run_command
from tests.reliability.cases import STARTUP_S, Case, Result
from tests.reliability.checkpoint_cases import MODEL, folder_digests
from tests.reliability.output_cases import kind_of, make, written_into

EXPORT = [sys.executable, "-m", "peerline.launch.export_checkpoint"]
LIMIT_S = 60


def _prepare(root: Path) -> Path:
    """The base checkpoint folder (iterations 2 and 4)."""
    root.mkdir(parents=True, exist_ok=True)
    p = run_command([sys.executable, PIPELINE, *MODEL, "--iters", "4", "--save", "base", "--save-every", "2"], root,
                    timeout=STARTUP_S + 60)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root / "base"


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _deep(ck: Path) -> None:
    (ck / "iter_000004" / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)


def _not_a_checkpoint(ck: Path) -> None:
    shutil.rmtree(ck)
    (ck / "iter_latest").mkdir(parents=True)
    (ck / "iter_latest" / "manifest.json").write_text(json.dumps({"format": "peerline-checkpoint-2"}))


#: (name, damage to the copy `ck`, DIR, --to (None: no --to flag) or a kind for output_cases.make, the refusal's
#: needle or None for an export that must succeed)
INPUTS: list[tuple[str, Callable[[Path], None], str, str | None, str | None]] = [
    ("a missing folder", lambda ck: None, "nope", "m.pt", "checkpoint directory nope does not exist"),
    ("a file as DIR", lambda ck: None, "ck/latest", "m.pt", "ck/latest is a file, not a checkpoint directory"),
    ("a folder without checkpoints", _not_a_checkpoint, "ck", "m.pt", "ck is not a checkpoint directory"),
    ("every checkpoint corrupt", lambda ck: [_flip(d / "__0_0.distcp") for d in ck.glob("iter_*")], "ck", "m.pt",
     "no checkpoint in ck verifies (the newest: checkpoint file ck/iter_000004/__0_0.distcp is corrupt"),
    ("the named checkpoint corrupt", lambda ck: _flip(ck / "iter_000004" / "__0_0.distcp"), "ck/iter_000004",
     "m.pt", "checkpoint file ck/iter_000004/__0_0.distcp is corrupt"),
    ("a manifest 200k-deep JSON", _deep, "ck/iter_000004", "m.pt", "its JSON nests too deeply"),
    ("a folder renamed", lambda ck: (ck / "iter_000002").rename(ck / "iter_000003"), "ck/iter_000003", "m.pt",
     "is the manifest of iteration 2, in the folder of iteration 3"),
    ("--to in a missing folder", lambda ck: None, "ck", "no/such/m.pt", "--to no/such/m.pt: the folder no/such does "
     "not exist"),
    ("--to a folder", lambda ck: None, "ck", "ck", "--to ck is a folder"),
    ("--to an unknown suffix", lambda ck: None, "ck", "m.bin", "--to m.bin: unknown suffix '.bin'"),
    ("--to in /proc", lambda ck: None, "ck", "/proc/peerline-m.pt", "--to /proc/peerline-m.pt: not writable"),
    ("--to through a link to /dev/full", lambda ck: None, "ck", "full", "cannot write into this character device"),
    ("--to a socket", lambda ck: None, "ck", "socket", "--to socket is a socket"),
    ("no --to", lambda ck: None, "ck", None, "the following arguments are required: --to"),
    ("--to through a link to /dev/null", lambda ck: None, "ck", "null", None),
    ("--to a fifo", lambda ck: None, "ck", "fifo", None),
]


def _kept(check: Callable[[Result], str], ck: Path) -> Callable[[Result], str]:
    """`check`, and "data lost" when the checkpoint folder changed."""
    before = folder_digests(ck) if ck.exists() else {}

    def kept(r: Result) -> str:
        outcome = check(r)
        return "data lost" if outcome == "clean" and before and folder_digests(ck) != before else outcome
    return kept


def cases(workdir: Path) -> list[Case]:
    root = workdir / "export_inputs"
    base = _prepare(root)
    found = []
    for i, (name, damage, source, to, needle) in enumerate(INPUTS):
        here = root / f"case{i:02d}"
        shutil.copytree(base, here / "ck")
        damage(here / "ck")
        special = to in ("full", "null", "fifo", "socket")
        target, reader = make(here, to) if special else (None, None)
        if needle is None:
            check = written_into(target, reader, "PK")  # torch.save's zip archive
        else:
            check = _refusal(needle, target)
        flags = [] if to is None else ["--to", to]
        found.append(Case(f"export: {name}", [*EXPORT, source, *flags], cpu_env(), LIMIT_S,
                          _kept(check, here / "ck"), workdir=here))
    return found


def _refusal(needle: str, special: Path | None) -> Callable[[Result], str]:
    """One `peerline: error:` line holding `needle`, exit 2; a special file at --to is what it was."""
    before = kind_of(special) if special is not None else None

    def check(r: Result) -> str:
        if special is not None and kind_of(special) != before:
            return "data lost"
        if "Traceback (most recent call last)" in r.out:
            return "traceback"
        if r.rc != 2 or len(r.errors) != 1 or needle not in r.errors[0]:
            return "misnamed"
        return "clean"
    return check


__all__ = ["cases", "INPUTS"]
