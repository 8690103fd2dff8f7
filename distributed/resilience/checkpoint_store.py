"""The checkpoint directory as a whole: which checkpoint to resume from, who may save into it, what is kept.

  prepare_save_dir(D, rank, resuming)   every rank: D writable; rank 0: the lock, leftover temporary files removed;
                                        a fresh run refuses a D that holds checkpoints already
  choose(D, rank, world, manifest, ...) every rank, collectively: the newest checkpoint whose files verify on every
                                        rank (manifest, each rank's share of the files' SHA-256), what was
                                        skipped and why
  prune(D, keep)                        rank 0 after a complete save: only the newest `keep` checkpoints stay

Resume never trusts `D/latest` alone: it lists D's `iter_NNNNNN` folders, newest first, and takes the first one
every rank can verify, so a missing `latest` or a corrupt newest checkpoint costs one checkpoint, not the run. A
checkpoint of another configuration (its manifest differs) is refused, not skipped. Newer checkpoints that failed
to verify are renamed `iter_NNNNNN.skipped` before this run writes its own of the same number; newer ones that
verify (resuming from an older one on purpose) make the run refuse: it never overwrites a checkpoint it did not
load from.

The lock `D/.peerline.lock` (created with O_EXCL; pid, host and Slurm job id inside) keeps a second job from
saving into D. A lock whose process is gone (same host, pid not running) or that belongs to this Slurm job (a
requeued or restarted job) is stale and taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from peerline import overrides
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience.checkpoint import CheckpointError

LOCK = ".peerline.lock"
_ITER = ckpt.ITER_NAME


def iterations(root: str | os.PathLike) -> list[int]:
    """The iterations of D's checkpoint folders, newest first (complete or not)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [int(m.group(1)) for m in map(_ITER.match, names) if m and Path(root, m.group(0)).is_dir()]
    return sorted(found, reverse=True)


def verify(root: Path, iteration: int, rank: int, expected: Mapping[str, Any], world: int = 1
           ) -> tuple[str, str] | None:
    """None when this rank's share of the checkpoint's files is sound; else (kind, reason): kind 'mismatch'
    (another model's checkpoint, an older format: refused) or 'bad' (incomplete or corrupt: skipped)."""
    try:
        manifest = ckpt.read_manifest(root, iteration)
    except ckpt.ForeignCheckpoint as exc:
        return "mismatch", str(exc)
    except CheckpointError as exc:
        return "bad", str(exc)
    diff = ckpt.compare_manifest(manifest, expected)
    if diff:
        return "mismatch", f"checkpoint {ckpt.iteration_dir(root, iteration)} does not match this run: {diff}"
    try:
        ckpt.verify_files(root, iteration, rank, world)
    except CheckpointError as exc:
        return "bad", str(exc)
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(obj: Any, world: int) -> list[Any]:
    """Every rank's `obj` (one all_gather_object; the object itself when alone)."""
    if not (dist.is_initialized() and world > 1):
        return [obj]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone


def choose(root: str | os.PathLike, rank: int, world: int, expected: Mapping[str, Any],
           say: Callable[[str], None]) -> tuple[int | None, list[int]]:
    """(the iteration to resume from, those skipped), the same on every rank (collective); None: none verifies.

    Each rank checks its own file of every candidate; the newest candidate sound on every rank wins. Rank 0 says
    which it skipped and why. A checkpoint of another configuration raises (on every rank alike)."""
    root = Path(root)
    candidates = iterations(root)
    mine = {it: verify(root, it, rank, expected, world) for it in candidates}
    everyone = _gather(mine, world)
    skipped: list[int] = []
    for it in candidates:
        problems = [(r, everyone[r].get(it, ("bad", "absent on this rank"))) for r in range(len(everyone))]
        problems = [(r, p) for r, p in problems if p is not None]
        mismatch = [p for _, p in problems if p[0] == "mismatch"]
        if mismatch:
            raise ckpt.ForeignCheckpoint(mismatch[0][1])
        if not problems:
            return it, skipped
        r, (_, reason) = problems[0]
        say(f"skipped checkpoint of iteration {it}: {reason}" + (f" (rank {r})" if world > 1 else ""))
        skipped.append(it)
    return None, skipped


def guard_newer(save_dir: str | os.PathLike, start: int, skipped: set[int]) -> None:
    """Before this run saves into `save_dir` from iteration `start`: newer checkpoints there are set aside when
    resume skipped them in this folder (they failed to verify), else the run refuses (it would overwrite them)."""
    save = Path(save_dir)
    newer = [it for it in iterations(save) if it > start]
    if not newer:
        return
    if not set(newer) <= skipped:
        raise CheckpointError(f"--save {save} holds checkpoints newer than iteration {start} that this run did not "
                              f"load from (iteration {', '.join(map(str, sorted(set(newer) - skipped)))}): resume "
                              f"from the newest with --resume {save}, or save into another directory")
    if _rank() == 0:
        for it in newer:
            d = ckpt.iteration_dir(save, it)
            aside = d.with_name(d.name + ".skipped")
            n = 1
            while aside.exists():
                n += 1
                aside = d.with_name(f"{d.name}.skipped{n}")
            os.replace(d, aside)
        if start:
            ckpt.write_latest(save, start)
        else:
            (save / ckpt.LATEST).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# the save directory


def prepare_save_dir(root: str | os.PathLike, rank: int, resuming: bool) -> Path:
    """Every rank: D is writable. Rank 0: takes the lock and removes temporary files of interrupted saves. A run
    that does not resume refuses a D that holds checkpoints (it would overwrite them)."""
    path = ckpt.check_writable(root)
    if not resuming and iterations(path):
        raise CheckpointError(f"--save {path} holds checkpoints already (iteration "
                              f"{', '.join(map(str, sorted(iterations(path))))}): continue them with --resume "
                              f"{path}, or save into another directory")
    if rank == 0:
        take_lock(path)
        remove_leftovers(path)
    return path


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": overrides.get("SLURM_JOB_ID")}


def _stale(held: Mapping[str, Any]) -> bool:
    """The lock's process is gone (same host), or it is this Slurm job's own (a requeue or a restart)."""
    me = _holder()
    if held.get("slurm_job") and held.get("slurm_job") == me["slurm_job"]:
        return True
    if held.get("host") != me["host"]:
        return False
    pid = held.get("pid")
    if not isinstance(pid, int) or pid == me["pid"]:
        return isinstance(pid, int)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def take_lock(root: Path) -> None:
    """Create D/.peerline.lock exclusively, taking over a stale one; a live one is a one-line CheckpointError."""
    lock = root / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                held = {}
            if not isinstance(held, dict) or not _stale(held):
                who = f"pid {held.get('pid')} on {held.get('host')}" if isinstance(held, dict) else "another job"
                raise CheckpointError(f"--save {root} is in use by another job ({who}): two jobs saving into one "
                                      f"directory would mix their checkpoints; if that job is gone, delete {lock}"
                                      ) from None
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_holder(), f)
        return
    raise CheckpointError(f"cannot take the lock {lock}: another job took it at the same time")


def release_lock(root: str | os.PathLike) -> None:
    """Remove the lock if this process holds it (the end of a run; a crash leaves a stale one, taken over later)."""
    lock = Path(root) / LOCK
    try:
        held = json.loads(lock.read_text())
    except (OSError, ValueError):
        return
    if isinstance(held, dict) and held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def remove_leftovers(root: Path) -> None:
    """Temporary files and folders of saves that were interrupted (atomic writes leave `.<name>.<random>.tmp`
    when killed, a checkpoint save its `.iter_NNNNNN.tmp` folder)."""
    for folder in [root, *(ckpt.iteration_dir(root, it) for it in iterations(root))]:
        for tmp in folder.glob(".*.tmp"):  # not the writability probes: other ranks write theirs meanwhile
            _remove(tmp)


def _remove(path: Path) -> None:
    """Remove a leftover file or folder (a link: the link); one that cannot be removed stays, as harmless."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def prune(root: str | os.PathLike, keep: int | None) -> list[int]:
    """Delete all but the newest `keep` checkpoints (rank 0, after a complete save); returns those deleted."""
    if not keep:
        return []
    gone = iterations(root)[keep:]
    for it in gone:
        shutil.rmtree(ckpt.iteration_dir(root, it), ignore_errors=True)
    return gone


# ---------------------------------------------------------------------------------------------------------------
# resuming


def resume(resume_dir: str | os.PathLike, save_dir: str | os.PathLike | None, rank: int, world: int,
           expected: Mapping[str, Any], say: Callable[[str], None],
           template: Callable[[dict[str, tuple[int, ...]]], dict[str, Any]]) -> ckpt.CheckpointState | None:
    """The checkpoint to continue from, loaded into `template(stored shapes)`'s tensors (collective); None for a
    fresh start, which only resuming from the run's own, still empty --save directory is (a launcher's first
    attempt)."""
    path = Path(resume_dir)
    gather = lambda obj: _gather(obj, world)  # noqa: E731 - the same collective for every load
    if path.name.startswith("iter_") and (path / ckpt.MANIFEST).exists():  # one checkpoint named explicitly
        state = ckpt.load_checkpoint(path, expected, template, rank=rank, world=world, gather=gather)
        if save_dir is not None:
            guard_newer(save_dir, state.iteration, set())
        return state
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    own = save_dir is not None and path.resolve() == Path(save_dir).resolve()
    chosen, skipped = choose(path, rank, world, expected, say)
    if chosen is None and not (own and not iterations(path)):
        raise CheckpointError(f"no checkpoint in {path} verifies" if skipped else f"no checkpoint in {path}")
    state = None if chosen is None else ckpt.load_checkpoint(path, expected, template, chosen, rank=rank,
                                                             world=world, gather=gather)
    if save_dir is not None:
        guard_newer(save_dir, chosen or 0, set(skipped) if own else set())
    return state


def precheck(save_dir: str | None, resume_dir: str | None) -> None:
    """Before any process group exists (every rank alike, so the job prints one line): the refusals a listing of
    the folders decides. A fresh run into a folder of checkpoints; an older checkpoint named while newer ones sit
    in --save; a --save folder locked by a live job. The collective checks (verification) come later."""
    if save_dir is None or not Path(save_dir).is_dir():
        return
    save = Path(save_dir)
    held = iterations(save)
    if resume_dir is None and held:
        raise CheckpointError(f"--save {save} holds checkpoints already (iteration "
                              f"{', '.join(map(str, sorted(held)))}): continue them with --resume {save}, or save "
                              "into another directory")
    named = Path(resume_dir) if resume_dir else None
    if named is not None and _ITER.match(named.name) and (named / ckpt.MANIFEST).exists():
        guard_newer(save, int(_ITER.match(named.name).group(1)), set())
    lock = save / LOCK
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return
    if isinstance(holder, dict) and not _stale(holder):
        raise CheckpointError(f"--save {save} is in use by another job (pid {holder.get('pid')} on "
                              f"{holder.get('host')}): two jobs saving into one directory would mix their "
                              f"checkpoints; if that job is gone, delete {lock}")
