"""Checkpoints: save and resume a pipeline run, atomically, as data (never code), on any grid.

Layout of a checkpoint directory DIR:

  DIR/iter_000003/manifest.json     what the run was (grid, model shape, data, config), the iteration, and the
                                    SHA-256 of every other file of the folder; written by rank 0, last
  DIR/iter_000003/.metadata         torch.distributed.checkpoint (DCP) metadata: which tensor is in which file
  DIR/iter_000003/__<r>_<n>.distcp  the tensors rank r wrote (dcp_io.py), under the whole model's names with
                                    global layer indices (checkpoint_names.py), so any grid loads any grid's
  DIR/latest                        the iteration of the newest complete checkpoint (a hint: resume finds the
                                    newest checkpoint that verifies without it, checkpoint_store.py)

Atomic: every rank writes into `DIR/.iter_000003.tmp` (DCP's writer fsyncs each file), every rank hashes its own
files, rank 0 writes the manifest with all the hashes, fsyncs the folder and renames it to `iter_000003` (atomic
within one file system), fsyncs DIR, then writes `latest`. A job killed half-way through a save leaves a `.tmp`
folder (removed by the next run, checkpoint_store.py) and the previous checkpoints as they were.

Checked on load: the manifest is JSON of the expected shape (`manifest_problem`: its fields' types, file names of
the folder only, the iteration of the folder's own name, so a folder renamed or copied does not verify); every
file of the folder must be listed in it with its SHA-256 (each rank
checks its share of the files, `.metadata` every rank, before it is read); DCP's `.metadata` pickle is read by a
restricted unpickler that resolves only DCP's metadata classes (dcp_io.py) and the tensors by torch.load with
weights_only=True: a checkpoint holds tensors and JSON, nothing that executes. Only what cannot be resharded is
refused (the model's shape: its kind, layer count, widths; a tensor this run's model has not or shapes
differently). Every failure is a `CheckpointError` with one line that names the file, field or tensor; a full disk
is named as such ("no space left on DIR while saving checkpoint N"), whichever exception reported it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.resilience.checkpoint_names import METADATA, MODEL
from peerline.files import atomic_write


def _dcp() -> Any:
    """resilience/dcp_io.py, imported on first use: torch.distributed.checkpoint takes seconds to import, which
    every rank would otherwise pay at start-up, checkpointing or not."""
    from peerline.distributed.resilience import dcp_io

    return dcp_io

log = logging.getLogger(__name__)

FORMAT = "peerline-checkpoint-2"
OLD_FORMATS = ("peerline-checkpoint-1",)
LATEST = "latest"
MANIFEST = "manifest.json"
#: A checkpoint folder's name: `iter_` and its iteration, six digits or more.
ITER_NAME = re.compile(r"^iter_(\d{6,})$")
#: How deep a manifest's JSON may nest (peerline writes three levels).
MAX_MANIFEST_DEPTH = 16
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or used; the message is one line meant for the user (exit code 2, like
    every bad input)."""


class ForeignCheckpoint(CheckpointError):
    """A checkpoint this run must refuse rather than skip (another model, an older format)."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Directory of the checkpoint taken after `iteration` completed iterations."""
    return Path(root) / f"iter_{iteration:06d}"


def folder_iteration(path: str | os.PathLike) -> int | None:
    """The iteration a checkpoint folder's name says (`iter_000004` -> 4); None for any other name."""
    m = ITER_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def temp_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Where the checkpoint of `iteration` is written before its rename (the same name on every rank)."""
    return Path(root) / f".iter_{iteration:06d}.tmp"


@dataclass
class CheckpointState:
    """What `load_checkpoint` gives back: the loaded tensors by checkpoint key, the manifest, the iteration."""

    iteration: int
    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    folder: Path


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


def capture_rng(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """RNG states of torch (CPU and this rank's CUDA device), Python `random` and NumPy, as tensors (a DCP
    checkpoint stores tensors only; `restore_rng` decodes them)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    assert name == "MT19937"
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys.astype(np.int64), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Mapping[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Inverse of `capture_rng`."""
    try:
        torch.set_rng_state(state["torch"].to(torch.uint8))
        py = [int(v) for v in state["python"].tolist()]
        gauss = float(state["python_gauss"][0])
        random.setstate((py[0], tuple(py[1:]), None if math.isnan(gauss) else gauss))
        np_state = state["numpy"].tolist()
        keys = np.array(np_state[:-2], dtype=np.uint32)
        np.random.set_state(("MT19937", keys, int(np_state[-2]), int(np_state[-1]), float(state["numpy_gauss"][0])))
        if device is not None and device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"].to(torch.uint8), device)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        raise CheckpointError(f"checkpoint RNG state is malformed: {_oneline(exc)}") from None


RNG_KINDS = ("torch", "python", "python_gauss", "numpy", "numpy_gauss", "cuda")


def rng_keys(rank: int) -> dict[str, str]:
    """Checkpoint key of each RNG state of `rank` (rank r of the grid that saved; another grid has other ranks)."""
    return {kind: f"rng.{rank}.{kind}" for kind in RNG_KINDS}


def save_checkpoint(root: str | os.PathLike, rank: int, iteration: int, state: Mapping[str, torch.Tensor],
                    manifest: Mapping[str, Any], *, barrier: Callable[[], None] | None = None,
                    gather: Callable[[Any], list[Any]] | None = None, process_group: Any = None,
                    after_write: Callable[[], None] | None = None) -> Path:
    """Write this rank's tensors (`state`, by checkpoint key) into the checkpoint of `iteration`; return its
    directory. Collective: every rank calls it with the same iteration; `gather` (every rank's object, e.g.
    dist.all_gather_object) and `barrier` (e.g. dist.barrier, called once the checkpoint is complete) are the
    job's, none for one process; `process_group`: DCP's (default: the default group; a background writer passes
    its own). `after_write` runs once this rank's files are written and hashed (injected slow or failing disks).
    `manifest` must be JSON-serialisable; rank 0 writes it."""
    root, barrier = Path(root), barrier or (lambda: None)
    gather = gather or (lambda obj: [obj])
    tmp, final = temp_dir(root, iteration), iteration_dir(root, iteration)
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save of the same iteration
            tmp.mkdir(parents=True)
        gather(None)  # nobody writes before rank 0 has cleared the folder (not `barrier`: that one is timed)
        group = {} if process_group is None else {"process_group": process_group}
        _dcp().save({k: v.detach() for k, v in state.items()}, tmp, **group)
        digests = {p.name: _sha256(p) for p in sorted(tmp.glob(f"__{rank}_*"))}
        if after_write is not None:
            after_write()
    except (OSError, RuntimeError, ValueError, _dcp().CheckpointException) as exc:
        raise write_error(final, iteration, exc) from None
    everyone = gather(digests)
    if rank == 0:
        try:
            files = {name: digest for part in everyone for name, digest in part.items()}
            files[METADATA] = _sha256(tmp / METADATA)
            text = json.dumps({"format": FORMAT, "iteration": iteration, **manifest, "files": files}, indent=2,
                              sort_keys=True, default=str)
            atomic_write(tmp / MANIFEST, lambda f: f.write(text.encode()))
            _publish(tmp, final)
            write_latest(root, iteration)
        except OSError as exc:
            raise write_error(final, iteration, exc) from None
        log.info("checkpoint of iteration %d written to %s", iteration, final)
    barrier()  # every rank returns once the checkpoint is complete
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the written folder to its final name, durably (the folder and its parent fsynced). A folder of the
    same iteration already there (saved again on purpose) is replaced only once the new one is complete."""
    _fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(f".{final.name}.old.tmp")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    if iteration is None and (path / MANIFEST).exists() and folder_iteration(path) is not None:
        return path.parent, folder_iteration(path)
    if iteration is None:
        iteration = latest_iteration(path)
    if iteration is None:  # no `latest`: the newest checkpoint folder (resume verifies it: checkpoint_store.py)
        found = sorted(int(p.name[len("iter_"):]) for p in path.glob("iter_*") if p.name[len("iter_"):].isdigit())
        if not found:
            raise CheckpointError(f"no checkpoint in {path}")
        iteration = found[-1]
    return path, iteration


def read_manifest(root: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """The manifest of a checkpoint (JSON); a missing, unreadable or malformed one (`manifest_problem`) is a
    CheckpointError, one of another format a ForeignCheckpoint."""
    root, iteration = _resolve(root, iteration)
    p = iteration_dir(root, iteration) / MANIFEST
    if p.exists() and not p.is_file():
        raise CheckpointError(f"checkpoint manifest {p} is not a file")
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint manifest {p} is missing") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint manifest {p} is unreadable: its JSON nests too deeply") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest {p} is unreadable: {_oneline(exc)}") from None
    if isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"] in OLD_FORMATS:
        raise ForeignCheckpoint(f"checkpoint {p.parent} is in the {data['format']} format of an older peerline, "
                                f"which this version does not read: resume it with that version")
    problem = manifest_problem(data, iteration)
    if problem:
        raise CheckpointError(f"checkpoint manifest {p} {problem}")
    return data


def _depth(value: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict | list) and d <= MAX_MANIFEST_DEPTH:
            todo.extend((child, d + 1) for child in (v.values() if isinstance(v, dict) else v))
    return deepest


def manifest_problem(data: Any, iteration: int) -> str | None:
    """What makes `data` no manifest of the checkpoint folder of `iteration`, as the end of a sentence; None when
    it is one: an object of this format, the folder's own iteration, a SHA-256 for each plain file name, objects
    where the run wrote objects."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"is not a {FORMAT} manifest"
    if _depth(data) > MAX_MANIFEST_DEPTH:
        return f"nests deeper than {MAX_MANIFEST_DEPTH} levels"
    saved = data.get("iteration")
    if type(saved) is not int:
        return f"holds no iteration number (iteration: {_show(saved)[:40]})"
    if saved != iteration:
        return (f"is the manifest of iteration {saved}, in the folder of iteration {iteration}: a checkpoint folder "
                "renamed or copied does not verify")
    files = data.get("files")
    if not isinstance(files, dict):
        return "lists no files (files: not an object)"
    for name, digest in files.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name or "\0" in name:
            return f"lists {name[:60]!r}, which is no file name of the folder"
        if not isinstance(digest, str) or not _SHA256.match(digest):
            return f"lists no SHA-256 for {name} ({_show(digest)[:40]})"
    if not isinstance(data.get("model"), dict):
        return "has no model object"
    wrong = [k for k in ("grid", "data", "config") if k in data and not isinstance(data[k], dict)]
    if wrong:
        return f"has a {wrong[0]} that is not an object"
    return None


def verify_files(root: str | os.PathLike, iteration: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Check this rank's share of the checkpoint's files (file i of the sorted list when i % world == rank, and
    `.metadata` on every rank) against the manifest's SHA-256, and that no file is unlisted; return the
    manifest. Else one-line CheckpointError."""
    manifest = read_manifest(root, iteration)
    folder = iteration_dir(root, iteration)
    files: dict[str, str] = manifest["files"]
    for p in sorted(folder.iterdir()):
        if p.name != MANIFEST and p.is_file() and p.name not in files:
            raise CheckpointError(f"checkpoint file {p} has no checksum in the manifest")
    names = sorted(files)
    mine = [n for i, n in enumerate(names) if i % world == rank or n == METADATA]
    for name in mine:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if _sha256(path) != files[name]:
            raise CheckpointError(f"checkpoint file {path} is corrupt or was modified (SHA-256 mismatch)")
    return manifest


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint folder with its shape, from DCP's metadata (restricted unpickler)."""
    try:
        return _dcp().tensor_shapes(_dcp().read_metadata(folder))
    except Exception as exc:  # noqa: BLE001 - any failure of the unpickler means the same thing to the user
        raise CheckpointError(f"checkpoint metadata {folder / METADATA} is unreadable: "
                              f"{type(exc).__name__}: {_oneline(exc)}") from None


def check_template(shapes: Mapping[str, tuple[int, ...]], template: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor this rank would load that the checkpoint lacks or shapes differently; None when all fit."""
    for key, tensor in template.items():
        if key not in shapes:
            return f"{key} is absent in the checkpoint"
        if tuple(shapes[key]) != tuple(tensor.shape):
            return f"{key} is {list(shapes[key])} in the checkpoint, {list(tensor.shape)} in this run"
    return None


def load_checkpoint(root: str | os.PathLike, expected_manifest: Mapping[str, Any],
                    template: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
                    iteration: int | None = None, *, rank: int = 0, world: int = 1,
                    gather: Callable[[Any], list[Any]] | None = None) -> CheckpointState:
    """Load the newest (or the given) checkpoint into the tensors `template(stored shapes)` returns (filled in
    place), after checking it belongs to this run (collective: every rank calls it; `gather` as in save).

    Raises CheckpointError (one line, on every rank alike) for: no checkpoint, a manifest that differs from
    `expected_manifest` (names the field and both values), a missing or tampered file, a tensor some rank's model
    lacks or shapes otherwise, a model tensor of the checkpoint no rank's model has."""
    root, iteration = _resolve(root, iteration)
    folder = iteration_dir(root, iteration)
    manifest = verify_files(root, iteration, rank, world)
    diff = compare_manifest(manifest, expected_manifest)
    if diff:
        raise ForeignCheckpoint(f"checkpoint {folder} does not match this run: {diff}")
    shapes = stored_shapes(folder)
    tensors = template(shapes)
    problem = check_template(shapes, tensors)
    everyone = (gather or (lambda obj: [obj]))((problem, [k for k in tensors if k.startswith(MODEL)]))
    problems = [p for p, _ in everyone if p]
    covered = {k for _, keys in everyone for k in keys}
    extra = sorted(k for k in shapes if k.startswith(MODEL) and k not in covered)
    if problems or extra:
        why = problems[0] if problems else f"{extra[0]} is in the checkpoint, not in this run's model"
        raise ForeignCheckpoint(f"checkpoint {folder} does not fit this model: {why}")
    try:
        _dcp().load(tensors, folder)
    except (Exception, _dcp().CheckpointException) as exc:  # noqa: BLE001 - any reader failure, one line
        raise CheckpointError(f"checkpoint {folder} cannot be read: {type(exc).__name__}: {_oneline(exc)}") from None
    return CheckpointState(iteration=iteration, tensors=tensors, manifest=manifest, folder=folder)


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



# ---------------------------------------------------------------------------------------------------------------


def _oneline(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _normal(v: Any) -> Any:
    """JSON turns tuples into lists: compare both sides as JSON would store them."""
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def _show(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)



#: RunConfig fields that fix the model's shape (a checkpoint of another shape cannot be resharded: refused);
#: everything else (grid, schedule, microbatches, dtype, kernels, ...) may change between save and resume.
SHAPE_FIELDS = ("model", "layers", "hidden")
#: RunConfig fields that decide which batches an iteration reads (a change is said on resume, not refused).
DATA_FIELDS = ("seed", "micro_batch_size", "seq", "token_data")


def build_manifest(cfg: Any, world_size: int, pp: int | None = None) -> dict[str, Any]:
    """The manifest of a run from its RunConfig (any object with the fields above; absent ones are skipped):
    `model` is what a resume compares; `grid`, `data` and `config` are what the run was (`pp`: the resolved one)."""
    def pick(names: tuple[str, ...]) -> dict[str, Any]:
        return {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}

    model = pick(SHAPE_FIELDS)
    if getattr(cfg, "model", None) == "gpt":
        model["heads"] = cfg.heads
    pp = pp if pp is not None else getattr(cfg, "pp", None)
    dp, micro = getattr(cfg, "dp", 1), getattr(cfg, "microbatches", 1)
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    return {
        "grid": {"pp": pp, "dp": dp, "stages": getattr(cfg, "stages", 1)},
        "world_size": world_size,
        "schedule": getattr(cfg, "schedule", None),
        "model": model,
        "data": {**pick(DATA_FIELDS), "global_microbatches": dp * micro},
        "config": json.loads(json.dumps(config, default=str)),
    }


def expected_of(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a resume requires of a checkpoint's manifest: the model's shape."""
    return {"model": dict(manifest["model"])}


def data_notice(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """A notice when the checkpoint's run read its batches otherwise than this one will (another seed, global
    batch or data): the resumed run is then not the run an uninterrupted one would have been."""
    before, now = saved.get("data") or {}, current.get("data") or {}
    changed = [k for k in sorted(now) if k in before and _normal(before[k]) != _normal(now[k])]
    if not changed:
        return None
    parts = ", ".join(f"{k} {_show(before[k])} -> {_show(now[k])}" for k in changed)
    return f"notice: the data differs from the checkpoint's run ({parts}): the iterations after the resume read " \
           "other batches than that run would have"
