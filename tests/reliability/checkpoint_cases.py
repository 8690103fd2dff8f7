"""Checkpoint attacks for the reliability suite (loaded by tests/reliability/cases.py): `cases(workdir)` returns one
`Case` per attack on a checkpoint folder of a 2-rank job (pp=2, forked ranks: tests/forkjob.py).

Built once here: an uninterrupted 6-iteration run (the reference) and a 4-iteration run saving at 2 and 4 (the
base folder). Each case gets its own copy of the base, damages it, and runs the job again:
  - resume cases must end with exit 0 and the reference's losses and parameters from the iteration they resumed
    at, saying what they skipped;
  - refusal cases must end with one `peerline: error:` line naming the problem;
and in every case the checkpoint of iteration 2 must be byte for byte what it was before the run ("data lost"
otherwise).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.helpers import PIPELINE, cpu_env, forkrun_cmd, run_command
from tests.reliability.cases import STARTUP_S, Case, Result, worker_traceback

MODEL = ["--hidden", "8", "--layers", "4", "--seq", "4", "--micro-batch-size", "2", "-m", "2", "--device", "cpu",
         "--timeout-s", "60"]
LIMIT_S = STARTUP_S + 60


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder`, by its path relative to it (what a run must leave as it is)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _swap_ranks(d: Path) -> None:
    a, b, t = d / "__0_0.distcp", d / "__1_0.distcp", d / "swap"
    a.rename(t)
    b.rename(a)
    t.rename(b)


def _unlisted(d: Path) -> None:
    """The manifest lists no checksum of rank 1's file."""
    manifest = json.loads((d / "manifest.json").read_text())
    del manifest["files"]["__1_0.distcp"]
    (d / "manifest.json").write_text(json.dumps(manifest))


def _all_corrupt(ck: Path) -> None:
    for d in ck.glob("iter_*"):
        _flip(d / "__1_0.distcp")


def _leftovers(ck: Path) -> None:
    (ck / ".latest.x1.tmp").write_text("3")
    (ck / "iter_000004" / ".manifest.json.x2.tmp").write_bytes(b"partial")
    (ck / ".iter_000006.tmp").mkdir()  # a save killed before its rename
    (ck / ".iter_000006.tmp" / "__0_0.distcp").write_bytes(b"partial")


def _swap_folders(ck: Path) -> None:
    a, b, t = ck / "iter_000002", ck / "iter_000004", ck / "swap"
    a.rename(t)
    b.rename(a)
    t.rename(b)


def _edit_manifest(d: Path, **fields: object) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    manifest.update(fields)
    (d / "manifest.json").write_text(json.dumps(manifest))


def _lock(pid: int) -> Callable[[Path], None]:
    def write(ck: Path) -> None:
        import socket

        (ck / ".peerline.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "slurm_job": None}))
    return write


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


#: (name, damage, extra flags, resumed-at iteration or None for a refusal, a needle the output must hold)
ATTACKS: list[tuple[str, Callable[[Path], None], list[str], int | None, str]] = [
    ("latest missing", lambda ck: (ck / "latest").unlink(), [], 4, "resumed from ck at iteration 4"),
    ("newest flipped byte", lambda ck: _flip(ck / "iter_000004" / "__1_0.distcp"), [], 2,
     "skipped checkpoint of iteration 4: checkpoint file ck/iter_000004/__1_0.distcp is corrupt"),
    ("newest truncated", lambda ck: (ck / "iter_000004" / "__0_0.distcp").write_bytes(b"PK"), [], 2,
     "skipped checkpoint of iteration 4"),
    ("newest checksum missing", lambda ck: _unlisted(ck / "iter_000004"), [], 2,
     "skipped checkpoint of iteration 4: checkpoint file ck/iter_000004/__1_0.distcp has no checksum"),
    ("newest manifest missing", lambda ck: (ck / "iter_000004" / "manifest.json").unlink(), [], 2,
     "skipped checkpoint of iteration 4"),
    ("newest rank files swapped", lambda ck: _swap_ranks(ck / "iter_000004"), [], 2,
     "skipped checkpoint of iteration 4"),
    ("leftover temporary files", _leftovers, [], 4, "resumed from ck at iteration 4"),
    ("stale lock of a dead process", lambda ck: _lock(_dead_pid())(ck), [], 4, "resumed from ck at iteration 4"),
    ("changed --lr", lambda ck: None, ["--lr", "0.002"], 4, "--lr 0.002 differs from the checkpoint's 0.001"),
    ("fresh run into a folder of checkpoints", lambda ck: None, ["--no-resume"], None,
     "--save ck holds checkpoints already"),
    ("older checkpoint named, newer ones kept", lambda ck: None, ["--resume", "ck/iter_000002"], None,
     "holds checkpoints newer than iteration 2"),
    ("folder locked by a live job", _lock(1), [], None, "is in use by another job"),
    ("every checkpoint corrupt", _all_corrupt, [], None, "no checkpoint in ck verifies"),
    ("another run's checkpoints", lambda ck: None, ["--hidden", "16"], None, "does not match this run"),
    ("older folder copied as a newer one", lambda ck: shutil.copytree(ck / "iter_000002", ck / "iter_000006"), [],
     4, "skipped checkpoint of iteration 6: checkpoint manifest ck/iter_000006/manifest.json is the manifest of "
        "iteration 2, in the folder of iteration 6"),
    ("two folders swapped", _swap_folders, [], None, "no checkpoint in ck verifies"),
    ("newest manifest 200k-deep JSON", lambda ck: (ck / "iter_000004" / "manifest.json").write_text(
        "[" * 200_000 + "]" * 200_000), [], 2, "skipped checkpoint of iteration 4: checkpoint manifest "
        "ck/iter_000004/manifest.json is unreadable: its JSON nests too deeply"),
    ("newest manifest's config a list", lambda ck: _edit_manifest(ck / "iter_000004", config=["lr"]), [], 2,
     "skipped checkpoint of iteration 4: checkpoint manifest ck/iter_000004/manifest.json has a config that is not "
     "an object"),
    ("newest manifest's data a string", lambda ck: _edit_manifest(ck / "iter_000004", data="seed"), [], 2,
     "skipped checkpoint of iteration 4: checkpoint manifest ck/iter_000004/manifest.json has a data that is not"),
    ("temporary folder left in a checkpoint", lambda ck: (ck / "iter_000004" / ".x.tmp").mkdir(), [], 4,
     "resumed from ck at iteration 4"),
]


def _prepare(root: Path) -> dict:
    """The reference run and the base folder; returns the reference record."""
    root.mkdir(parents=True, exist_ok=True)
    for args in (["--iters", "6", "--json", "ref.json"], ["--iters", "4", "--save", "base", "--save-every", "2"]):
        p = run_command([*forkrun_cmd(2), PIPELINE, *MODEL, *args], root, timeout=STARTUP_S + 120)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((root / "ref.json").read_text())


def _check(workdir: Path, start: int | None, needle: str, kept: dict[str, str], reference: dict
           ) -> Callable[[Result], str]:
    def check(r: Result) -> str:
        if worker_traceback(r.out):
            return "traceback"
        if folder_digests(workdir / "ck" / "iter_000002") != kept:
            return "data lost"
        if needle not in r.out:
            return "misnamed"
        if start is None:  # a refusal: one line, a failed job
            return "clean" if r.rc not in (0, None) and len(r.errors) == 1 else "misnamed"
        if r.rc != 0 or r.errors:
            return "misnamed"
        got = json.loads((workdir / "out.json").read_text())
        same = got["iterations"] == list(range(start + 1, 7))
        if "--lr" in needle:  # another learning rate: other losses by design; the notice is what counts
            return "clean" if same else "data lost"
        if not same or got["losses"] != reference["losses"][start:] \
                or got["layer_checksums"] != reference["layer_checksums"]:
            return "data lost"
        return "clean"
    return check


def cases(workdir: Path) -> list[Case]:
    root = workdir / "checkpoint_attacks"
    reference = _prepare(root)
    found = []
    for i, (name, damage, extra, start, needle) in enumerate(ATTACKS):
        here = root / f"case{i:02d}"
        shutil.copytree(root / "base", here / "ck")
        damage(here / "ck")
        kept = folder_digests(here / "ck" / "iter_000002")  # what the run must leave as it is
        resume = [] if "--no-resume" in extra or "--resume" in extra else ["--resume", "ck"]
        args = [a for a in extra if a != "--no-resume"]
        cmd = [*forkrun_cmd(2), PIPELINE, *MODEL, "--iters", "6", "--save", "ck", "--save-every", "2", *resume,
               *args, "--json", "out.json"]
        found.append(Case(f"checkpoint: {name}", cmd, cpu_env(), LIMIT_S, _check(here, start, needle, kept,
                                                                                    reference), workdir=here))
    return found


__all__ = ["cases", "ATTACKS"]
