"""The --json record of a run: its resolved configuration, what each logged iteration measured, the final loss,
parameter checksums and the versions (peerline, its git commit, the libraries and card), written by rank 0.
launch/pipeline.py adds every rank's `optimizer_state_bytes` and `state_bytes` (parameters, gradients and
optimizer state by kind: memory/state_bytes.py); the peak memory less those is activations and workspaces.

`check_outputs` runs at start-up on every rank, before anything is built: a --json, --metrics-jsonl or --timeline
file whose folder is missing or that names a folder, a --tensorboard, --profile or --save folder that is a file,
any of them where no file can be written (a probe file is written and removed: /proc, a read-only mount), or
tensorboard not installed, is one ConfigError line then rather than a failure after training. A file output that
is a character device or a FIFO is written into, never replaced (peerline/files.py): a device must take an empty
write (/dev/full refuses it); a block device or a socket is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import peerline
from peerline.distributed.config import ConfigError, RunConfig, flag_name
from peerline.distributed.observe.tensorboard import require_tensorboard
from peerline.distributed.observe.versions import versions
from peerline.distributed.precision import compute_dtype
from peerline.files import WRITTEN_INTO, atomic_write, special_kind
from peerline.kernels import ops

GIT_TIMEOUT_S = 10.0


def check_outputs(cfg: RunConfig) -> None:
    """Every output the run will write can be written (see the module docstring)."""
    for name in ("json", "metrics_jsonl"):
        if getattr(cfg, name):
            check_file(flag_name(name), Path(getattr(cfg, name)))
    if cfg.timeline:
        for suffix in (".png", ".json"):
            check_file("--timeline", Path(cfg.timeline + suffix))
    for name in ("tensorboard", "profile", "save"):
        if getattr(cfg, name):
            check_folder(flag_name(name), Path(getattr(cfg, name)))
    if cfg.tensorboard:
        require_tensorboard()


def check_file(flag: str, path: Path) -> None:
    """`path` can be created or overwritten: its folder exists and is writable, and it is no folder itself; or it
    is a character device or FIFO that can be written into."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: give a file name")
    kind = special_kind(path)
    if kind is not None:
        check_special(flag, path, kind)
        return
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable")
    probe_write(flag, path, folder)


def check_special(flag: str, path: Path, kind: str) -> None:
    """A special file output: a character device must take an empty write, a FIFO be writable; other kinds are
    refused. Nothing is written beside it (its folder may be /dev)."""
    if kind not in WRITTEN_INTO:
        raise ConfigError(f"{flag} {path} is a {kind}: give a file name, a character device or a FIFO")
    if kind == "FIFO":  # opening it would wait for a reader: its permission is all there is to check now
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path}: not writable")
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write into this {kind} ({exc.strerror or exc})") from None


def check_folder(flag: str, path: Path) -> None:
    """`path` is a folder, or can be made one: its nearest existing ancestor is a writable folder."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create it: {exc.strerror or exc}") from None
    probe_write(flag, path, path)


def probe_write(flag: str, path: Path, folder: Path) -> None:
    """Write and remove a file in `folder`: os.access trusts permission bits, which root ignores and which say
    nothing of /proc or a read-only mount."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".peerline-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: not writable ({exc.strerror or exc})") from None


def git_commit() -> str | None:
    """`git rev-parse HEAD` of the checkout peerline runs from; None for an installed copy, without git, or when
    git fails."""
    root = Path(peerline.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def resolved_config(rt: Any) -> dict[str, object]:
    """The configuration as the run ran it: pp from the world, the device, dtype and kernels it resolved to, and
    whether the iteration was a CUDA graph."""
    cfg = rt.cfg.to_dict()
    cfg.update(pp=rt.mesh.pp, device=rt.device.type, graph=rt.graph is not None,
               dtype=compute_dtype(rt.cfg, rt.device),
               kernels=ops.resolve_impl(rt.cfg.kernels, rt.device))
    return cfg


def build_record(rt: Any, history: list[Any], checksums: dict[str, list[float]]) -> dict[str, object]:
    """The record of a finished run from its runtime, the stats of its logged iterations and the checksums."""
    return {"config": resolved_config(rt), "world_size": rt.info.world_size, "launcher": rt.info.launcher,
            "transport": rt.transport_name, "graph": rt.graph is not None,
            "graph_loop": rt.graph_loop, "graph_loop_failed": rt.graph_loop_failed,
            "final_loss": history[-1].loss if history else None, "iterations_done": rt.iteration,
            "losses": [s.loss for s in history], "iterations": [s.iteration for s in history],
            "ms_per_iter": [s.ms for s in history], "tokens_per_s": [s.tokens_per_s for s in history],
            "peak_mem_gb": max((s.peak_mem_gb for s in history), default=0.0),
            "peak_mem_gb_per_rank": history[-1].peak_mem_gb_per_rank if history else None,
            "tflops": [s.tflops for s in history], "mfu": [s.mfu for s in history],
            "ppl": [s.ppl for s in history], "layer_checksums": checksums,
            "peerline_version": peerline.__version__, "git_commit": git_commit(), "versions": versions()}


def write_record(path: str, record: dict[str, object]) -> None:
    """Write `record` as indented JSON, atomically (a reader never sees half a record); into `path` when it is a
    character device or FIFO. A failed write is one ConfigError line."""
    text = json.dumps(record, indent=1)
    try:
        atomic_write(Path(path), lambda f: f.write(text.encode()))
    except OSError as exc:
        raise ConfigError(f"--json {path}: cannot write the record ({exc.strerror or exc})") from None
