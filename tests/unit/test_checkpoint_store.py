"""The checkpoint directory as a whole (resilience/checkpoint_store.py), one process: resume finds the newest
checkpoint that verifies without `latest`, skips a corrupt or incomplete one and says so, refuses another run's,
never overwrites what it did not load; the lock; --keep; leftover temporary files and folders; a full disk named as
such; a changed --lr said."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_names as names
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience.run_state import resume_notices

pytestmark = pytest.mark.timeout(60)

MANIFEST = {"model": {"hidden": 8, "layers": 2}}
DATA = "__0_0.distcp"  # the tensors of rank 0 (DCP's file name)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 8)).square().mean().backward()
    opt.step()
    return m, opt


def _save(root: Path, iteration: int, manifest=MANIFEST) -> dict[str, torch.Tensor]:
    m, opt = _model(iteration)
    stages = [(m, 0)]
    state = {names.MODEL + k: v for k, v in names.stage_modules(stages).items()}
    state.update(names.flatten_optimizer(names.optimizer_state(opt, names.param_names(stages))))
    ckpt.save_checkpoint(root, 0, iteration, state, manifest)
    return {k: v.clone() for k, v in state.items() if k.startswith(names.MODEL)}


def _template(shapes: dict) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s) for k, s in shapes.items() if k.startswith(names.MODEL)}


def _resume(root: Path, save: Path | None = None) -> tuple[ckpt.CheckpointState | None, list[str]]:
    said: list[str] = []
    return store.resume(root, save, 0, 1, MANIFEST, said.append, _template), said


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_latest_finds_the_newest(tmp_path):
    weights = {it: _save(tmp_path, it) for it in (2, 4, 6)}
    (tmp_path / "latest").unlink()
    state, said = _resume(tmp_path)
    assert state.iteration == 6 and _same(state.tensors, weights[6]) and said == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_digest", "no_manifest", "no_rank_file"])
def test_a_damaged_newest_is_skipped_with_its_reason(tmp_path, damage):
    weights = {it: _save(tmp_path, it) for it in (2, 4, 6)}
    d = tmp_path / "iter_000006"
    f = d / DATA
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "no_digest":
        manifest = json.loads((d / "manifest.json").read_text())
        del manifest["files"][DATA]
        (d / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "no_manifest":
        (d / "manifest.json").unlink()
    else:
        f.unlink()
    state, said = _resume(tmp_path, save=tmp_path)
    assert state.iteration == 4 and _same(state.tensors, weights[4])
    assert len(said) == 1 and said[0].startswith("skipped checkpoint of iteration 6: "), said
    # the skipped checkpoint is set aside, not overwritten by the resumed run's own iteration 6
    assert not d.exists() and (tmp_path / "iter_000006.skipped").is_dir()
    assert ckpt.latest_iteration(tmp_path) == 4


def test_another_runs_checkpoint_is_refused_not_skipped(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4, manifest={"model": {"hidden": 8, "layers": 3}})
    with pytest.raises(ckpt.CheckpointError, match="model.layers is 3 in the checkpoint, 2 in this run"):
        _resume(tmp_path)


def test_nothing_to_resume(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        _resume(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="^no checkpoint in"):
        _resume(tmp_path / "empty")
    # the run's own, still empty save directory: a fresh start (a launcher restart's first attempt)
    assert _resume(tmp_path / "empty", save=tmp_path / "empty") == (None, [])
    _save(tmp_path / "bad", 2)
    (tmp_path / "bad" / "iter_000002" / DATA).write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .* verifies"):
        _resume(tmp_path / "bad")


def test_never_overwrites_a_checkpoint_it_did_not_load(tmp_path):
    for it in (2, 4, 6):
        _save(tmp_path / "a", it)
    # an older checkpoint named explicitly, saving into its folder: 4 and 6 would be overwritten
    with pytest.raises(ckpt.CheckpointError, match=r"holds checkpoints newer than iteration 2 .*iteration 4, 6"):
        _resume(tmp_path / "a" / "iter_000002", save=tmp_path / "a")
    # resuming from a into b, which holds a newer checkpoint of its own
    _save(tmp_path / "b", 8)
    with pytest.raises(ckpt.CheckpointError, match="iteration 8"):
        _resume(tmp_path / "a", save=tmp_path / "b")
    # a fresh run (no --resume) into a folder of checkpoints
    with pytest.raises(ckpt.CheckpointError, match=r"holds checkpoints already \(iteration 8\)"):
        store.prepare_save_dir(tmp_path / "b", 0, resuming=False)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["iter_000002", "iter_000004", "iter_000006",
                                                                   "latest"]


def test_lock_refuses_a_live_job_and_takes_over_a_dead_ones(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    store.prepare_save_dir(tmp_path, 0, resuming=False)
    lock = tmp_path / store.LOCK
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        held = json.loads(lock.read_text())
        lock.write_text(json.dumps({**held, "pid": live.pid}))
        with pytest.raises(ckpt.CheckpointError, match=f"in use by another job \\(pid {live.pid} on "):
            store.prepare_save_dir(tmp_path, 0, resuming=True)
    finally:
        live.kill()
        live.wait()
    store.prepare_save_dir(tmp_path, 0, resuming=True)  # that pid is gone now: a stale lock
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    store.release_lock(tmp_path)
    assert not lock.exists()
    # another host's lock is never taken, unless it is this Slurm job's own (a requeued job)
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "slurm_job": "77"}))
    with pytest.raises(ckpt.CheckpointError, match="in use by another job"):
        store.prepare_save_dir(tmp_path, 0, resuming=True)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    store.prepare_save_dir(tmp_path, 0, resuming=True)


def test_keep_and_leftover_temporary_files(tmp_path):
    for it in (1, 2, 3, 4):
        _save(tmp_path, it)
    assert store.prune(tmp_path, 2) == [2, 1]
    assert store.iterations(tmp_path) == [4, 3]
    assert store.prune(tmp_path, None) == []
    leftovers = [tmp_path / ".latest.abc.tmp", tmp_path / "iter_000004" / ".manifest.json.xyz.tmp",
                 tmp_path / ".iter_000005.tmp" / DATA]
    leftovers[-1].parent.mkdir()
    for p in leftovers:
        p.write_bytes(b"partial")
    store.prepare_save_dir(tmp_path, 0, resuming=True)
    assert not any(p.exists() for p in leftovers) and not (tmp_path / ".iter_000005.tmp").exists()
    assert (tmp_path / "iter_000004" / DATA).exists()


@pytest.mark.parametrize("how", ["errno", "zip_writer"])
def test_full_disk_is_named(tmp_path, monkeypatch, how):
    _save(tmp_path, 2)

    def full(obj, f, *a, **k):
        f.write(b"partial")
        if how == "errno":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:858] . unexpected pos 277696 vs 277648")

    monkeypatch.setattr(torch, "save", full)
    # torch.save's zip writer hides the errno: a nearly full disk is what names it
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 4096))
    with pytest.raises(ckpt.CheckpointError) as e:
        _save(tmp_path, 4)
    assert str(e.value) == f"no space left on {tmp_path / 'iter_000004'} while saving checkpoint 4"
    monkeypatch.undo()
    assert _resume(tmp_path)[0].iteration == 2  # the earlier checkpoint survives


def test_full_tmpfs(tmp_path):
    """A real full file system: a 64 KiB tmpfs (root only)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and permission to mount")
    try:
        with pytest.raises(ckpt.CheckpointError, match=f"^no space left on {mnt}/iter_000001 while saving "
                                                       "checkpoint 1$"):
            m = torch.nn.Linear(256, 256)
            ckpt.save_checkpoint(mnt, 0, 1, dict(m.state_dict()), MANIFEST)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_changed_lr_is_said(tmp_path):
    saved = {"config": {"lr": 1e-2}}
    said: list[str] = []
    resume_notices(saved, {}, 1e-2, said.append)
    assert said == []
    resume_notices(saved, {}, 3e-3, said.append)
    assert said == ["notice: --lr 0.003 differs from the checkpoint's 0.01: using --lr 0.003"]


def test_precheck_refuses_before_any_process_group(tmp_path, monkeypatch):
    """The refusals a listing decides run before the process group (every rank alike: one line per job)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    store.precheck(str(tmp_path / "none"), None)  # nothing there yet: fine
    for it in (2, 4):
        _save(tmp_path, it)
    with pytest.raises(ckpt.CheckpointError, match=r"holds checkpoints already \(iteration 2, 4\)"):
        store.precheck(str(tmp_path), None)
    with pytest.raises(ckpt.CheckpointError, match="newer than iteration 2"):
        store.precheck(str(tmp_path), str(tmp_path / "iter_000002"))
    store.precheck(str(tmp_path), str(tmp_path))
    (tmp_path / store.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": __import__("socket").gethostname()}))
    with pytest.raises(ckpt.CheckpointError, match="in use by another job"):
        store.precheck(str(tmp_path), str(tmp_path))


# ---- folders renamed or copied, malformed manifests: they do not verify, resume falls back and says why


def test_a_folder_copied_or_renamed_does_not_verify(tmp_path):
    weights = {it: _save(tmp_path, it) for it in (2, 4, 6)}
    shutil.copytree(tmp_path / "iter_000002", tmp_path / "iter_000008")  # 2 copied as 8
    state, said = _resume(tmp_path)
    assert state.iteration == 6 and _same(state.tensors, weights[6])
    assert said == [f"skipped checkpoint of iteration 8: checkpoint manifest {tmp_path}/iter_000008/manifest.json "
                    "is the manifest of iteration 2, in the folder of iteration 8: a checkpoint folder renamed or "
                    "copied does not verify"]
    shutil.rmtree(tmp_path / "iter_000008")
    (tmp_path / "iter_000006").rename(tmp_path / "swap")  # 4 and 6 swapped
    (tmp_path / "iter_000004").rename(tmp_path / "iter_000006")
    (tmp_path / "swap").rename(tmp_path / "iter_000004")
    state, said = _resume(tmp_path)
    assert state.iteration == 2 and _same(state.tensors, weights[2])
    assert [line.split(":")[0] for line in said] == ["skipped checkpoint of iteration 6",
                                                     "skipped checkpoint of iteration 4"]
    with pytest.raises(ckpt.CheckpointError, match="is the manifest of iteration 6, in the folder of iteration 4"):
        _resume(tmp_path / "iter_000004")  # named explicitly: refused in one line


def _edit_manifest(d: Path, change) -> None:
    manifest = json.loads((d / "manifest.json").read_text())
    change(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))


MALFORMED = {
    "200k-deep JSON": (lambda d: (d / "manifest.json").write_text("[" * 200_000 + "]" * 200_000),
                       "is unreadable: its JSON nests too deeply"),
    "deep in a field": (lambda d: _edit_manifest(d, lambda m: m.update(config=json.loads("[" * 500 + "]" * 500))),
                        "nests deeper than"),
    "a list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), "is not a peerline-checkpoint-2 manifest"),
    "iteration a string": (lambda d: _edit_manifest(d, lambda m: m.update(iteration="6")),
                           "holds no iteration number"),
    "files a list": (lambda d: _edit_manifest(d, lambda m: m.update(files=[DATA])), "lists no files"),
    "checksum a number": (lambda d: _edit_manifest(d, lambda m: m["files"].update({DATA: 6})),
                          f"lists no SHA-256 for {DATA}"),
    "a file outside the folder": (lambda d: _edit_manifest(d, lambda m: m["files"].update(
        {"../iter_000004/" + DATA: "0" * 64})), "which is no file name of the folder"),
    "model a list": (lambda d: _edit_manifest(d, lambda m: m.update(model=[8, 2])), "has no model object"),
    "data a string": (lambda d: _edit_manifest(d, lambda m: m.update(data="seed")), "has a data that is not an"),
    "config a list": (lambda d: _edit_manifest(d, lambda m: m.update(config=["lr"])), "has a config that is not"),
    "format a list": (lambda d: _edit_manifest(d, lambda m: m.update(format=["peerline-checkpoint-1"])),
                      "is not a peerline-checkpoint-2 manifest"),
    "manifest a folder": (lambda d: ((d / "manifest.json").unlink(), (d / "manifest.json").mkdir()),
                          "is not a file"),
}


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_a_malformed_manifest_is_skipped_with_its_reason(tmp_path, damage):
    weights = {it: _save(tmp_path, it) for it in (4, 6)}
    change, reason = MALFORMED[damage]
    change(tmp_path / "iter_000006")
    state, said = _resume(tmp_path, save=tmp_path)
    assert state.iteration == 4 and _same(state.tensors, weights[4])
    assert len(said) == 1 and said[0].startswith("skipped checkpoint of iteration 6: ") and reason in said[0], said


def test_leftover_temporary_folders_are_removed(tmp_path):
    _save(tmp_path, 4)
    for d in (tmp_path / ".x.tmp", tmp_path / "iter_000004" / ".x.tmp", tmp_path / ".iter_000004.old.tmp"):
        d.mkdir()
        (d / "f").write_bytes(b"partial")
    (tmp_path / ".link.tmp").symlink_to(tmp_path / "iter_000004")
    store.prepare_save_dir(tmp_path, 0, resuming=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".peerline.lock", "iter_000004", "latest"]
    assert (tmp_path / "iter_000004" / DATA).exists() and _resume(tmp_path)[0].iteration == 4
