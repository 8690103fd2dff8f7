"""Checkpoints (DCP format): atomic layout, round trip of weights / optimizer / RNG by global names, manifest and
shape checks, refusal of corrupt or code-carrying files, a save killed by SIGKILL, the sharded-optimizer adapter,
the export to a plain state_dict."""

from __future__ import annotations

import os
import pickle
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_names as names
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience import dcp_io
from peerline.launch import export_checkpoint

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
MANIFEST = {"model": {"hidden": 8, "layers": 4, "model": None}}


def _stage(seed: int, layers: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(layers)])


def _trained(stages: list[tuple[nn.Module, int]], steps: int = 2) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([p for m, _ in stages for p in m.parameters()], lr=1e-2)
    for _ in range(steps):
        x = torch.randn(4, 8)
        for m, _ in stages:
            x = m(x)
        x.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _tensors(stages, opt) -> dict[str, torch.Tensor]:
    found = {names.MODEL + k: v for k, v in names.stage_modules(stages).items()}
    found.update(names.flatten_optimizer(names.optimizer_state(opt, names.param_names(stages))))
    return found


def _template(stages):
    pn = names.param_names(stages)

    def make(shapes):
        found = {names.MODEL + k: v for k, v in names.stage_modules(stages).items()}
        found.update(names.flatten_optimizer(names.optimizer_template(((n, p) for p, n in pn.items()), shapes)))
        return found
    return make


def _optim_of(state: ckpt.CheckpointState) -> dict[str, dict[str, torch.Tensor]]:
    full: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.tensors.items():
        if k.startswith(names.OPTIM):
            name, entry = k[len(names.OPTIM):].rsplit(".", 1)
            full.setdefault(name, {})[entry] = v
    return full


def _save_two_stages(root: Path, iteration: int = 3, seed: int = 0):
    """A 4-layer model as two stages of 2 layers (pp=2 on one process: both ranks' tensors in one save)."""
    stages = [(_stage(seed), 0), (_stage(seed + 1), 2)]
    opt = _trained(stages)
    ckpt.save_checkpoint(root, 0, iteration, _tensors(stages, opt), MANIFEST)
    return stages, opt


def test_global_names():
    assert names.global_name("3.fc1.weight", 14) == "layers.17.fc1.weight"
    assert names.global_name("0", 2) == "layers.2"
    stages = [(_stage(0), 0), (_stage(1), 2)]
    assert sorted(names.stage_modules(stages))[:2] == ["layers.0.0.bias", "layers.0.0.weight"]
    assert "layers.3.1.weight" in names.stage_modules(stages)


def test_layout_latest_and_no_leftovers(tmp_path):
    _save_two_stages(tmp_path, iteration=3)
    d = tmp_path / "iter_000003"
    assert sorted(p.name for p in d.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    manifest = ckpt.read_manifest(tmp_path, 3)
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"} and manifest["iteration"] == 3
    assert (tmp_path / "latest").read_text().strip() == "3"
    assert not list(tmp_path.glob(".*")), "temporary folder or file left behind"
    _save_two_stages(tmp_path, iteration=6)
    assert ckpt.latest_iteration(tmp_path) == 6 and (tmp_path / "iter_000003").is_dir()


@pytest.mark.parametrize("split", [[(0, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]])
def test_two_stages_load_into_any_split(tmp_path, split):
    """pp=2 -> pp=1 and other splits: every layer's weights and AdamW state land under its global index."""
    src, src_opt = _save_two_stages(tmp_path, seed=3)
    whole = [p for m, _ in src for p in m.parameters()]  # the source's parameters in global order
    moments = [src_opt.state[p] for p in whole]
    full = nn.Sequential(*[layer for m, _ in src for layer in m])
    dst_layers = list(_stage(9, layers=4))
    dst = [(nn.Sequential(*dst_layers[a:b]), a) for a, b in split]
    dst_opt = torch.optim.AdamW([p for m, _ in dst for p in m.parameters()], lr=1e-2)
    state = store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template(dst))
    names.load_optimizer_state(dst_opt, names.param_names(dst), _optim_of(state))
    got = [p for m, _ in dst for p in m.parameters()]
    for want, have, moment in zip(whole, got, moments, strict=True):
        assert torch.equal(want, have)
        for key in names.ADAM_KEYS:
            assert torch.equal(moment[key], dst_opt.state[have][key]), key
    x = torch.randn(2, 8)
    y = x
    for m, _ in dst:
        y = m(y)
    assert torch.equal(full(x), y)


def test_rng_round_trip():
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    rng = ckpt.capture_rng()
    draws = (random.random(), float(np.random.rand()), float(np.random.randn()), float(torch.rand(())))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ckpt.restore_rng(rng)
    assert (random.random(), float(np.random.rand()), float(np.random.randn()), float(torch.rand(()))) == draws
    with pytest.raises(ckpt.CheckpointError, match="RNG state is malformed"):
        ckpt.restore_rng({"torch": rng["torch"]})


def test_shape_and_layer_count_mismatch_is_refused_in_one_line(tmp_path):
    _save_two_stages(tmp_path)
    with pytest.raises(ckpt.ForeignCheckpoint, match="model.hidden is 8 in the checkpoint, 16 in this run") as e:
        store.resume(tmp_path, None, 0, 1, {"model": {**MANIFEST["model"], "hidden": 16}}, print, _template([]))
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)
    wide = [(nn.Sequential(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16))), 0)]
    with pytest.raises(ckpt.CheckpointError, match=r"layers.0.1.weight is \[8, 8\] in the checkpoint, \[16, 8\]"):
        store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template(wide))
    fewer = [(_stage(0, layers=3), 0)]  # the checkpoint has a layer 3 this model has not
    with pytest.raises(ckpt.CheckpointError, match="layers.3.0.bias is in the checkpoint, not in this run's model"):
        store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template(fewer))
    more = [(_stage(0, layers=5), 0)]
    with pytest.raises(ckpt.CheckpointError, match="model.layers.4.0.weight is absent in the checkpoint"):
        store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template(more))


def test_corrupt_and_unlisted_files_are_refused(tmp_path):
    _save_two_stages(tmp_path)
    d = tmp_path / "iter_000003"
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10
    (d / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0.distcp is corrupt or was modified \(SHA-256"):
        ckpt.verify_files(tmp_path, 3)
    _save_two_stages(tmp_path, iteration=4)
    (tmp_path / "iter_000004" / "__7_0.distcp").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match="__7_0.distcp has no checksum in the manifest"):
        ckpt.verify_files(tmp_path, 4)
    # each rank checks its share; .metadata every rank
    _save_two_stages(tmp_path, iteration=5)
    (tmp_path / "iter_000005" / dcp_io.METADATA).write_bytes(b"junk")
    for rank in (0, 1):
        with pytest.raises(ckpt.CheckpointError, match="metadata is corrupt|.metadata is corrupt"):
            ckpt.verify_files(tmp_path, 5, rank, 2)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_naming_a_callable_is_never_executed(tmp_path, monkeypatch):
    """A .metadata that calls os.system is refused by the restricted unpickler, even with a matching checksum."""
    monkeypatch.chdir(tmp_path)
    _save_two_stages(tmp_path)
    d = tmp_path / "iter_000003"
    (d / dcp_io.METADATA).write_bytes(pickle.dumps(_Boom()))
    manifest = ckpt.read_manifest(tmp_path, 3)
    manifest["files"][dcp_io.METADATA] = ckpt._sha256(d / dcp_io.METADATA)
    (d / ckpt.MANIFEST).write_text(__import__("json").dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=r"metadata .* is unreadable: UnpicklingError: posix.system"):
        store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template([(_stage(0, 4), 0)]))
    assert not (tmp_path / "PWNED").exists()
    pickle.loads((d / dcp_io.METADATA).read_bytes())  # a plain unpickler runs it (so this test can fail)
    assert (tmp_path / "PWNED").exists()


def test_older_format_is_refused_not_skipped(tmp_path):
    d = tmp_path / "iter_000002"
    d.mkdir()
    (d / "manifest.json").write_text('{"format": "peerline-checkpoint-1", "iteration": 2}')
    with pytest.raises(ckpt.ForeignCheckpoint, match="peerline-checkpoint-1 format of an older peerline"):
        store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template([]))


def test_failed_write_keeps_previous_and_names_a_full_disk(tmp_path, monkeypatch):
    _save_two_stages(tmp_path, iteration=2)

    def full_disk(state, folder):
        (Path(folder) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_io, "save", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"^no space left on \S*iter_000004 while saving checkpoint 4$"):
        _save_two_stages(tmp_path, iteration=4)
    monkeypatch.undo()
    assert ckpt.latest_iteration(tmp_path) == 2 and not (tmp_path / "iter_000004").exists()
    store.remove_leftovers(tmp_path)
    assert not list(tmp_path.glob(".iter_*"))
    assert store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template([(_stage(0, 4), 0)])).iteration == 2


KILLED_SAVE = """
import sys, time, torch
from peerline.distributed.resilience import checkpoint as ckpt, dcp_io
root = sys.argv[1]
state = {"model.layers.0.weight": torch.randn(256, 256)}
ckpt.save_checkpoint(root, 0, 2, state, {"model": {}})
real = dcp_io.save
def slow(state, folder):
    real(state, folder)
    print("written", flush=True)
    time.sleep(60)  # killed here: the files are written, the folder not yet renamed
dcp_io.save = slow
ckpt.save_checkpoint(root, 0, 4, state, {"model": {}})
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout.readline().strip() == "written"
        assert list((tmp_path / ".iter_000004.tmp").glob("*.distcp"))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        p.kill()
    assert store.iterations(tmp_path) == [2] and ckpt.latest_iteration(tmp_path) == 2
    target = {"model.layers.0.weight": torch.zeros(256, 256)}
    state = store.resume(tmp_path, None, 0, 1, {"model": {}}, print, lambda shapes: target)
    assert state.iteration == 2 and target["model.layers.0.weight"].abs().sum() > 0
    store.prepare_save_dir(tmp_path, 0, resuming=True)  # the next run removes the interrupted save
    assert not (tmp_path / ".iter_000004.tmp").exists()
    store.release_lock(tmp_path)


class FakeShardedAdamW:
    """A ZeRO-1 optimizer's checkpoint interface (grad_sync/sharded_adamw.py's): full_state() / load_full_state()
    by its own parameter names ('<global layer>.<name in the layer>', its `names`), backed by a plain AdamW (what
    the real one gathers over dp)."""

    def __init__(self, inner: torch.optim.AdamW, names_of: dict) -> None:
        self.inner = inner
        self.names = {p: n[len("layers."):] for p, n in names_of.items()}
        self.param_groups = inner.param_groups

    def full_state(self):
        return {self.names[p]: dict(s) for p, s in self.inner.state.items()}

    def load_full_state(self, state):
        by_name = {n: p for p, n in self.names.items()}
        for name, entries in state.items():
            self.inner.state[by_name[name]] = {k: v.clone() for k, v in entries.items()}


@pytest.mark.parametrize("save_sharded, load_sharded", [(True, False), (False, True)])
def test_sharded_and_unsharded_optimizers_share_the_format(tmp_path, save_sharded, load_sharded):
    src = [(_stage(4, 4), 0)]
    opt = _trained(src)
    src_names = names.param_names(src)
    saver = FakeShardedAdamW(opt, src_names) if save_sharded else opt
    ckpt.save_checkpoint(tmp_path, 0, 1, _tensors(src, saver), MANIFEST)
    dst = [(_stage(5, 2), 0), (_stage(6, 2), 2)]
    dst_opt = torch.optim.AdamW([p for m, _ in dst for p in m.parameters()], lr=1e-2)
    dst_names = names.param_names(dst)
    loader = FakeShardedAdamW(dst_opt, dst_names) if load_sharded else dst_opt
    state = store.resume(tmp_path, None, 0, 1, MANIFEST, print, _template(dst))
    names.load_optimizer_state(loader, dst_names, _optim_of(state))
    for (p, name), q in zip(src_names.items(), [p for m, _ in dst for p in m.parameters()], strict=True):
        assert dst_names[q] == name and torch.equal(p, q)
        for key in names.ADAM_KEYS:
            assert torch.equal(opt.state[p][key], dst_opt.state[q][key])


def test_export_round_trip(tmp_path, capsys):
    stages, _ = _save_two_stages(tmp_path / "ck", seed=7)
    assert export_checkpoint.main([str(tmp_path / "ck"), "--to", str(tmp_path / "model.pt")]) == 0
    assert "exported the model of" in capsys.readouterr().out
    fresh = nn.Module()
    fresh.layers = _stage(11, 4)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    x = torch.randn(3, 8)
    want = x
    for m, _ in stages:
        want = m(want)
    assert torch.equal(fresh.layers(x), want)
    target = tmp_path / "model.safetensors"
    rc = export_checkpoint.main([str(tmp_path / "ck" / "iter_000003"), "--to", str(target)])
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert rc == 2 and "needs the safetensors package" in capsys.readouterr().err
        return
    assert rc == 0
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in load_file(target).items())


def test_export_refuses_a_missing_folder_in_one_line(tmp_path, capsys):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "peerline.launch.export_checkpoint", str(tmp_path / "nope"), "--to",
                           str(tmp_path / "m.pt")], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"peerline: error: checkpoint directory {tmp_path / 'nope'} does not exist"], proc.stderr
    assert time.monotonic() - t0 < 60


EXPORT_REFUSALS = {
    "a file as DIR": (["ck/latest", "--to", "m.pt"], "ck/latest is a file, not a checkpoint directory"),
    "a folder without checkpoints": ([".", "--to", "m.pt"], ". is not a checkpoint directory: it holds no "
                                                            "iter_NNNNNN folder"),
    "a deep manifest": (["ck/iter_000003", "--to", "m.pt"], "checkpoint manifest ck/iter_000003/manifest.json is "
                                                            "unreadable: its JSON nests too deeply"),
    "--to in a missing folder": (["ck", "--to", "no/m.pt"], "--to no/m.pt: the folder no does not exist"),
    "--to a folder": (["ck", "--to", "ck"], "--to ck is a folder: give a file name"),
    "--to an unknown suffix": (["ck", "--to", "m.bin"], "--to m.bin: unknown suffix '.bin'; give a file name "
                                                        "ending in .pt, .pth, .safetensors"),
    "--to through a link to /dev/full": (["ck", "--to", "full"], "--to full: cannot write into this character "
                                                                 "device (No space left on device)"),
    "no --to": (["ck"], "the following arguments are required: --to (see --help)"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_REFUSALS))
def test_export_refuses_bad_input_in_one_line(tmp_path, monkeypatch, capsys, case):
    _save_two_stages(tmp_path / "ck", seed=7)
    (tmp_path / "full").symlink_to("/dev/full")
    if case == "a deep manifest":
        (tmp_path / "ck" / "iter_000003" / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    monkeypatch.chdir(tmp_path)
    argv, line = EXPORT_REFUSALS[case]
    try:
        rc = export_checkpoint.main(argv)
    except SystemExit as exc:  # argparse's way out
        rc = exc.code
    assert rc == 2 and capsys.readouterr().err.splitlines() == [f"peerline: error: {line}"]
    assert not list(tmp_path.glob("m.*")) and os.path.islink(tmp_path / "full")


def test_export_writes_into_a_fifo_and_a_link_to_dev_null(tmp_path, capsys):
    import threading

    _save_two_stages(tmp_path / "ck", seed=7)
    fifo, null = tmp_path / "fifo", tmp_path / "null"
    os.mkfifo(fifo)
    null.symlink_to("/dev/null")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert export_checkpoint.main([str(tmp_path / "ck"), "--to", str(fifo)]) == 0
    reader.join(10)
    assert got and got[0][:2] == b"PK" and stat.S_ISFIFO(os.stat(fifo).st_mode)  # torch.save's zip archive
    assert export_checkpoint.main([str(tmp_path / "ck"), "--to", str(null)]) == 0
    assert null.is_symlink() and stat.S_ISCHR(os.stat(null).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_check_writable(tmp_path):
    assert ckpt.check_writable(tmp_path / "a" / "b").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="is not writable") as e:
        ckpt.check_writable(blocker / "sub")
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "a" / "b").iterdir()), "the probe file was left behind"


def test_build_manifest_and_data_notice():
    cfg = RunConfig(pp=2, dp=1, schedule="gpipe", microbatches=8, hidden=64, iters=10)
    m = ckpt.build_manifest(cfg, world_size=2)
    assert m["grid"] == {"pp": 2, "dp": 1, "stages": 1} and m["model"]["hidden"] == 64
    assert m["config"]["lr"] == cfg.lr and m["data"]["global_microbatches"] == 8
    assert ckpt.expected_of(m) == {"model": m["model"]}  # only the model's shape is required
    other_grid = ckpt.build_manifest(RunConfig(pp=1, dp=2, schedule="1f1b", microbatches=4, hidden=64), 2)
    assert ckpt.compare_manifest(other_grid, ckpt.expected_of(m)) is None
    assert ckpt.data_notice(m, other_grid) is None  # 1 x 8 and 2 x 4 microbatches: the same batches
    notice = ckpt.data_notice(m, ckpt.build_manifest(RunConfig(pp=2, microbatches=4, hidden=64, seed=3), 2))
    assert "global_microbatches 8 -> 4" in notice and "seed 0 -> 3" in notice
