"""Checkpoints: save and resume a pipeline run, atomically, as data (never code).

Layout of a checkpoint directory DIR:

  DIR/iter_000003/manifest.json   what the run was (grid, schedule, microbatches, model config, world size),
                                  written by rank 0
  DIR/iter_000003/rank00000.pt    one file per rank: its stage weights, optimizer state, RNG states, iteration
  DIR/iter_000003/rank00000.sha256  the SHA-256 of that file (a tampered file is refused before it is unpickled)
  DIR/latest                      the iteration of the newest complete checkpoint, written last (a hint: resume
                                  finds the newest checkpoint that verifies without it, checkpoint_store.py)

Every file is written to a temporary name in the same directory, flushed, fsynced and renamed over its final name
(`os.replace` is atomic within one file system), and the directory is fsynced so the rename itself survives a
crash. `latest` is written only after every rank has finished (the caller passes a barrier), so a job killed
half-way through a save leaves `latest` pointing at the previous complete checkpoint.

The iteration stored is the number of iterations completed; a resumed run continues with that iteration index.
Loading uses `torch.load(..., weights_only=True)`: a checkpoint can hold tensors, numbers, strings, lists, tuples
and dicts, nothing that executes. Every failure is a `CheckpointError` with one line that names the file or field;
a full disk is named as such ("no space left on DIR while saving checkpoint N"), whichever exception reported it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peerline.distributed.config import ConfigError
from peerline.files import atomic_write

log = logging.getLogger(__name__)

FORMAT = "peerline-checkpoint-1"
LATEST = "latest"
MANIFEST = "manifest.json"


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or used; the message is one line meant for the user (exit code 2, like
    every bad input)."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Directory of the checkpoint taken after `iteration` completed iterations."""
    return Path(root) / f"iter_{iteration:06d}"


def rank_file(root: str | os.PathLike, iteration: int, rank: int) -> Path:
    return iteration_dir(root, iteration) / f"rank{rank:05d}.pt"


@dataclass
class CheckpointState:
    """What one rank gets back from `load_checkpoint`."""

    iteration: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    rng: dict[str, Any]
    manifest: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# writing


def check_writable(root: str | os.PathLike) -> Path:
    """Create `root` if needed and prove a file can be written and renamed there; else one-line CheckpointError.

    Call it on every rank before training starts, so a bad --save path fails in a second, not after an hour.
    Note that root ignores permission bits: this test writes a real file rather than trusting os.access.
    """
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory")
        fd, tmp = tempfile.mkstemp(prefix=".peerline-probe-", dir=path)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {path} is not writable: {_oneline(exc)}") from None
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """RNG states of torch (CPU and this rank's CUDA device), Python `random` and NumPy, as checkpointable data."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # weights_only loading refuses NumPy arrays: the key table travels as a tensor.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Inverse of `capture_rng`."""
    try:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        if device is not None and device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint RNG state is malformed: {_oneline(exc)}") from None


def save_checkpoint(root: str | os.PathLike, rank: int, iteration: int, stage_state: Mapping[str, torch.Tensor],
                    optimizer_state: Mapping[str, Any] | None, rng: Mapping[str, Any], manifest: Mapping[str, Any],
                    *, barrier: Callable[[], None] | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Write this rank's part of the checkpoint after `iteration` completed iterations; return its directory.

    Every rank calls this with the same `iteration`. `barrier` (e.g. `torch.distributed.barrier`) is called
    once every rank's file is durable; rank 0 then writes `latest`. Without a barrier (one process) rank 0
    writes `latest` at once. `manifest` must be JSON-serialisable; rank 0 writes it.
    """
    root = Path(root)
    d = iteration_dir(root, iteration)
    payload = {
        "format": FORMAT,
        "rank": rank,
        "iteration": iteration,
        "model": {k: v.detach() for k, v in stage_state.items()},
        "optimizer": optimizer_state,
        "rng": dict(rng),
        "extra": dict(extra or {}),
    }
    try:
        if rank == 0:
            text = json.dumps({"format": FORMAT, "iteration": iteration, **manifest}, indent=2, sort_keys=True)
            atomic_write(d / MANIFEST, lambda f: f.write(text.encode()))
        path = rank_file(root, iteration, rank)
        atomic_write(path, lambda f: torch.save(payload, f))
        digest = _sha256(path)
        atomic_write(path.with_suffix(".sha256"), lambda f: f.write(f"{digest}  {path.name}\n".encode()))
    except (OSError, RuntimeError) as exc:  # torch.save's zip writer reports a full disk as a RuntimeError
        raise write_error(d, iteration, exc) from None
    if barrier is not None:
        barrier()
    if rank == 0:
        try:
            write_latest(root, iteration)
        except OSError as exc:
            raise write_error(root, iteration, exc) from None
        log.info("checkpoint of iteration %d written to %s", iteration, d)
    return d


def write_latest(root: str | os.PathLike, iteration: int) -> None:
    """`root/latest` names `iteration` (atomically): the newest complete checkpoint."""
    atomic_write(Path(root) / LATEST, lambda f: f.write(f"{iteration}\n".encode()))


#: Free bytes under which a failed write is taken for a full disk (torch.save's zip writer hides the errno).
FULL_DISK_BYTES = 1 << 20


def write_error(folder: Path, iteration: int, exc: BaseException) -> CheckpointError:
    """One line for a failed checkpoint write: a full disk is named as such, whatever exception reported it."""
    full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    if not full and not isinstance(exc, OSError):
        probe = folder if folder.exists() else folder.parent
        try:
            full = shutil.disk_usage(probe).free < FULL_DISK_BYTES
        except OSError:
            full = False
    if full:
        return CheckpointError(f"no space left on {folder} while saving checkpoint {iteration}")
    return CheckpointError(f"cannot write checkpoint {folder} of iteration {iteration}: {_oneline(exc)}")


# ---------------------------------------------------------------------------------------------------------------
# reading


def latest_iteration(root: str | os.PathLike) -> int | None:
    """Iteration named by `root/latest`, or None when `root` holds no checkpoint yet."""
    p = Path(root) / LATEST
    if not p.exists():
        return None
    try:
        text = p.read_text().strip()
        return int(text)
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{p} is unreadable or does not hold an iteration number") from None


def _resolve(root: str | os.PathLike, iteration: int | None) -> tuple[Path, int]:
    """(checkpoint root, iteration). `root` may be the checkpoint root or one iter_NNNNNN directory in it."""
    path = Path(root)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if iteration is None and (path / MANIFEST).exists() and path.name.startswith("iter_"):
        try:
            return path.parent, int(path.name[len("iter_"):])
        except ValueError:
            pass
    if iteration is None:
        iteration = latest_iteration(path)
    if iteration is None:  # no `latest`: the newest checkpoint folder (resume verifies it: checkpoint_store.py)
        found = sorted(int(p.name[len("iter_"):]) for p in path.glob("iter_*") if p.name[len("iter_"):].isdigit())
        if not found:
            raise CheckpointError(f"no checkpoint in {path}")
        iteration = found[-1]
    return path, iteration


def read_manifest(root: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    root, iteration = _resolve(root, iteration)
    p = iteration_dir(root, iteration) / MANIFEST
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint manifest {p} is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest {p} is unreadable: {_oneline(exc)}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{p} is not a {FORMAT} manifest")
    return data


def compare_manifest(saved: Mapping[str, Any], expected: Mapping[str, Any], prefix: str = "") -> str | None:
    """First field of `expected` whose value differs in `saved`, as one line; None when all match.

    Only the fields of `expected` are compared, so a run may change what does not affect its state (--iters, the
    transport, timeline paths) simply by leaving it out of the manifest."""
    for key, want in expected.items():
        name = f"{prefix}{key}"
        if key not in saved:
            return f"{name} is absent in the checkpoint, {_show(want)} in this run"
        have = saved[key]
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            diff = compare_manifest(have, want, prefix=f"{name}.")
            if diff:
                return diff
        elif _normal(have) != _normal(want):
            return f"{name} is {_show(have)} in the checkpoint, {_show(want)} in this run"
    return None


def load_checkpoint(root: str | os.PathLike, rank: int, expected_manifest: Mapping[str, Any],
                    iteration: int | None = None) -> CheckpointState:
    """Load this rank's part of the newest (or the given) checkpoint, after checking it belongs to this run.

    Raises CheckpointError (one line) for: no checkpoint, a manifest that differs from `expected_manifest`
    (names the field and both values), a missing, truncated or tampered rank file."""
    root, iteration = _resolve(root, iteration)
    manifest = read_manifest(root, iteration)
    diff = compare_manifest(manifest, expected_manifest)
    if diff:
        raise CheckpointError(f"checkpoint {iteration_dir(root, iteration)} does not match this run: {diff}")
    path = verify_rank_file(root, iteration, rank)
    try:
        # weights_only: only tensors and plain containers are rebuilt; a pickle that names a callable is refused.
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure of the unpickler means the same thing to the user
        raise CheckpointError(f"checkpoint file {path} is truncated or not a peerline checkpoint: "
                              f"{type(exc).__name__}: {_oneline(exc)}") from None
    _check_payload(path, data, rank, iteration)
    return CheckpointState(iteration=iteration, model=data["model"], optimizer=data["optimizer"], rng=data["rng"],
                           manifest=manifest, extra=data.get("extra") or {})


def verify_rank_file(root: str | os.PathLike, iteration: int, rank: int) -> Path:
    """This rank's file of the checkpoint, present and equal to its recorded SHA-256; else one-line
    CheckpointError."""
    path = rank_file(root, iteration, rank)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    digest_file = path.with_suffix(".sha256")
    try:
        want, named = digest_file.read_text().split()[:2]
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint checksum {digest_file} is missing or unreadable") from None
    if named != path.name:  # the file and its checksum moved together from another rank's name
        raise CheckpointError(f"checkpoint checksum {digest_file} is the checksum of {named}, not of {path.name}")
    if _sha256(path) != want:
        raise CheckpointError(f"checkpoint file {path} is corrupt or was modified (SHA-256 mismatch)")
    return path


def _check_payload(path: Path, data: Any, rank: int, iteration: int) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not a {FORMAT} file")
    for key, kind in (("model", dict), ("rng", dict)):
        if not isinstance(data.get(key), kind):
            raise CheckpointError(f"checkpoint file {path} has no valid '{key}' entry")
    if data.get("rank") != rank or data.get("iteration") != iteration:
        raise CheckpointError(f"checkpoint file {path} holds rank {data.get('rank')} iteration "
                              f"{data.get('iteration')}, expected rank {rank} iteration {iteration}")


def apply_checkpoint(state: CheckpointState, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     device: torch.device | None = None) -> int:
    """Load weights, optimizer state and RNG states into this rank's objects; return the iteration to continue
    from. A state dict that does not fit the stage (other shapes or names) is a one-line CheckpointError."""
    try:
        module.load_state_dict(state.model, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint weights do not fit this stage: {_oneline(exc)}") from None
    if optimizer is not None:
        if state.optimizer is None:
            raise CheckpointError("checkpoint holds no optimizer state")
        try:
            optimizer.load_state_dict(state.optimizer)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint optimizer state does not fit: {_oneline(exc)}") from None
    restore_rng(state.rng, device)
    return state.iteration


# ---------------------------------------------------------------------------------------------------------------


def _oneline(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _normal(v: Any) -> Any:
    """JSON turns tuples into lists: compare both sides as JSON would store them."""
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def _show(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


#: RunConfig fields that decide what a checkpoint holds or what the resumed losses are; fields left out (iters,
#: device, kernels, p2p, graph, json, timeline, timeout_s, log_every) may change between save and resume.
GRID_FIELDS = ("pp", "dp", "stages")
MODEL_FIELDS = ("model", "layers", "hidden", "seq", "micro_batch_size", "dtype", "seed")


def build_manifest(cfg: Any, world_size: int) -> dict[str, Any]:
    """The manifest of a run from its RunConfig (any object with the fields above; absent ones are skipped).
    Grid first, so a resume on another grid is reported as a grid mismatch rather than a consequence of it."""
    def pick(names: tuple[str, ...]) -> dict[str, Any]:
        return {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}

    return {
        "grid": pick(GRID_FIELDS),
        "world_size": world_size,
        "schedule": getattr(cfg, "schedule", None),
        "microbatches": getattr(cfg, "microbatches", None),
        "model": pick(MODEL_FIELDS),
    }
