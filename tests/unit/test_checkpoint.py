"""Checkpoints: atomic layout, round trip of weights / optimizer / RNG, manifest checks, refusal of bad files."""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.resilience import checkpoint as ckpt

pytestmark = pytest.mark.timeout(60)

MANIFEST = {"grid": {"pp": 2, "dp": 1, "stages": 1}, "world_size": 2, "schedule": "1f1b", "microbatches": 4,
            "model": {"hidden": 32, "layers": 4, "dtype": "fp32"}}


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return m, opt


def _save(root: Path, rank: int = 0, iteration: int = 3, manifest=MANIFEST, seed: int = 0) -> torch.nn.Module:
    m, opt = _model_and_opt(seed)
    ckpt.save_checkpoint(root, rank, iteration, m.state_dict(), opt.state_dict(), ckpt.capture_rng(), manifest)
    return m


def test_layout_and_latest_pointer(tmp_path):
    _save(tmp_path, iteration=3)
    d = tmp_path / "iter_000003"
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "rank00000.pt", "rank00000.sha256"]
    assert (tmp_path / "latest").read_text().strip() == "3"
    assert not [p for p in tmp_path.rglob("*.tmp")], "temporary files left behind"
    _save(tmp_path, iteration=6)
    assert ckpt.latest_iteration(tmp_path) == 6
    assert (tmp_path / "iter_000003").is_dir(), "older checkpoints are kept"


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    src = _save(tmp_path, seed=1)
    _, src_opt = _model_and_opt(1)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected_draws = None
    rng = ckpt.capture_rng()
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    ckpt.save_checkpoint(tmp_path, 0, 4, src.state_dict(), src_opt.state_dict(), rng, MANIFEST)

    dst, dst_opt = _model_and_opt(2)  # different weights and moments
    assert not torch.equal(dst[0].weight, src[0].weight)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    state = ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    assert state.iteration == 4
    assert ckpt.apply_checkpoint(state, dst, dst_opt) == 4
    for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = src_opt.state_dict()["state"], dst_opt.state_dict()["state"]
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][name], sb[k][name]), name
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected_draws


def test_load_given_iteration_directory(tmp_path):
    _save(tmp_path, iteration=2)
    _save(tmp_path, iteration=5)
    assert ckpt.load_checkpoint(tmp_path / "iter_000002", 0, MANIFEST).iteration == 2
    assert ckpt.load_checkpoint(tmp_path, 0, MANIFEST, iteration=2).iteration == 2
    assert ckpt.load_checkpoint(tmp_path, 0, MANIFEST).iteration == 5


@pytest.mark.parametrize("change, needle", [
    ({"grid": {"pp": 1, "dp": 2, "stages": 1}}, "grid.pp is 2 in the checkpoint, 1 in this run"),
    ({"schedule": "gpipe"}, 'schedule is "1f1b" in the checkpoint, "gpipe" in this run'),
    ({"model": {"hidden": 64, "layers": 4, "dtype": "fp32"}}, "model.hidden is 32 in the checkpoint, 64 in this run"),
    ({"microbatches": 8}, "microbatches is 4 in the checkpoint, 8 in this run"),
    ({"extra_field": 1}, "extra_field is absent in the checkpoint, 1 in this run"),
])
def test_manifest_mismatch_names_field_and_both_values(tmp_path, change, needle):
    _save(tmp_path)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(tmp_path, 0, {**MANIFEST, **change})
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert isinstance(e.value, ConfigError)  # the entry point prints it as one line and exits 2


def test_missing_checkpoint_and_missing_rank_file(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nope", 0, MANIFEST)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    _save(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"rank00001\.pt is missing"):
        ckpt.load_checkpoint(tmp_path, 1, MANIFEST)


def test_truncated_file_is_refused(tmp_path):
    _save(tmp_path)
    f = tmp_path / "iter_000003" / "rank00000.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="corrupt or was modified"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    # Also without the checksum's help (a truncated file whose checksum was "fixed"): the unpickler refuses.
    (tmp_path / "iter_000003" / "rank00000.sha256").write_text(f"{ckpt._sha256(f)}  rank00000.pt\n")
    with pytest.raises(ckpt.CheckpointError, match="truncated or not a peerline checkpoint") as e:
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    assert "\n" not in str(e.value)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_tampered_file_never_executes_code(tmp_path, monkeypatch):
    """A pickle that names a callable is refused by weights_only loading, even with a matching checksum."""
    monkeypatch.chdir(tmp_path)
    _save(tmp_path)
    f = tmp_path / "iter_000003" / "rank00000.pt"
    payload = {"format": ckpt.FORMAT, "rank": 0, "iteration": 3, "model": {}, "optimizer": None, "rng": {},
               "evil": _Boom()}
    # torch.save would refuse nothing: write a torch-format zip whose data.pkl calls os.system.
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(payload, protocol=2))
        z.writestr("archive/version", "3\n")
    (tmp_path / "iter_000003" / "rank00000.sha256").write_text(f"{ckpt._sha256(f)}  rank00000.pt\n")
    with pytest.raises(ckpt.CheckpointError, match="truncated or not a peerline checkpoint"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    assert not (tmp_path / "PWNED").exists()
    # The file is a working exploit: a full unpickler would have run it (so this test can fail).
    torch.load(f, weights_only=False)
    assert (tmp_path / "PWNED").exists()


def test_modified_weights_are_caught_by_checksum(tmp_path):
    m = _save(tmp_path)
    f = tmp_path / "iter_000003" / "rank00000.pt"
    sd = {k: v + 1 for k, v in m.state_dict().items()}
    torch.save({"format": ckpt.FORMAT, "rank": 0, "iteration": 3, "model": sd, "optimizer": None, "rng": {}}, f)
    with pytest.raises(ckpt.CheckpointError, match="SHA-256 mismatch"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)


def test_file_of_other_rank_or_iteration_is_refused(tmp_path):
    _save(tmp_path, rank=0)
    _save(tmp_path, rank=1)
    d = tmp_path / "iter_000003"
    for ext in (".pt", ".sha256"):
        (d / f"rank00001{ext}").unlink()
        os.link(d / f"rank00000{ext}", d / f"rank00001{ext}")
    with pytest.raises(ckpt.CheckpointError, match=r"rank00001\.sha256 is the checksum of rank00000\.pt"):
        ckpt.load_checkpoint(tmp_path, 1, MANIFEST)
    # the checksum rewritten to match: the payload itself names its rank
    digest = (d / "rank00000.sha256").read_text().split()[0]
    (d / "rank00001.sha256").unlink()
    (d / "rank00001.sha256").write_text(f"{digest}  rank00001.pt\n")
    with pytest.raises(ckpt.CheckpointError, match="holds rank 0 iteration 3, expected rank 1 iteration 3"):
        ckpt.load_checkpoint(tmp_path, 1, MANIFEST)


def test_garbage_latest_and_manifest(tmp_path):
    _save(tmp_path)
    (tmp_path / "latest").write_text("three\n")
    with pytest.raises(ckpt.CheckpointError, match="does not hold an iteration number"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    (tmp_path / "latest").write_text("3\n")
    (tmp_path / "iter_000003" / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="manifest .* is unreadable"):
        ckpt.load_checkpoint(tmp_path, 0, MANIFEST)


def test_crash_mid_save_keeps_previous_latest(tmp_path, monkeypatch):
    _save(tmp_path, iteration=2)

    def exploding_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", exploding_save)
    with pytest.raises(ckpt.CheckpointError, match=r"^no space left on \S*iter_000004 while saving checkpoint 4$"):
        _save(tmp_path, iteration=4)
    monkeypatch.undo()
    assert ckpt.latest_iteration(tmp_path) == 2
    assert not (tmp_path / "iter_000004" / "rank00000.pt").exists()
    assert not [p for p in tmp_path.rglob("*.tmp")], "temporary file left behind"
    assert ckpt.load_checkpoint(tmp_path, 0, MANIFEST).iteration == 2


def test_latest_is_written_after_the_barrier(tmp_path):
    order = []
    m, opt = _model_and_opt(0)

    def barrier():
        order.append(("barrier", (tmp_path / "latest").exists()))

    ckpt.save_checkpoint(tmp_path, 0, 1, m.state_dict(), opt.state_dict(), ckpt.capture_rng(), MANIFEST,
                         barrier=barrier)
    assert order == [("barrier", False)]
    assert ckpt.latest_iteration(tmp_path) == 1
    # Rank 1 never writes `latest` or the manifest.
    other = tmp_path / "other"
    ckpt.save_checkpoint(other, 1, 1, m.state_dict(), None, ckpt.capture_rng(), MANIFEST)
    assert not (other / "latest").exists() and not (other / "iter_000001" / "manifest.json").exists()


def test_check_writable(tmp_path):
    assert ckpt.check_writable(tmp_path / "a" / "b").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="is not writable") as e:
        ckpt.check_writable(blocker / "sub")
    assert "\n" not in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="is not writable"):
        ckpt.check_writable(blocker)
    assert not list((tmp_path / "a" / "b").iterdir()), "the probe file was left behind"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_check_writable_read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ckpt.CheckpointError, match="is not writable"):
            ckpt.check_writable(ro)
    finally:
        ro.chmod(0o700)


def test_apply_checkpoint_to_wrong_stage_is_one_line(tmp_path):
    _save(tmp_path)
    state = ckpt.load_checkpoint(tmp_path, 0, MANIFEST)
    other = torch.nn.Sequential(torch.nn.Linear(8, 32))
    with pytest.raises(ckpt.CheckpointError, match="do not fit this stage") as e:
        ckpt.apply_checkpoint(state, other, None)
    assert "\n" not in str(e.value)


def test_build_manifest_from_run_config():
    cfg = RunConfig(pp=2, dp=1, schedule="gpipe", microbatches=8, hidden=64, iters=10)
    m = ckpt.build_manifest(cfg, world_size=2)
    assert m["grid"] == {"pp": 2, "dp": 1, "stages": 1}
    assert m["schedule"] == "gpipe" and m["microbatches"] == 8 and m["model"]["hidden"] == 64
    # Things a resume may change are not in the manifest.
    flat = str(m)
    for absent in ("iters", "timeout", "p2p", "kernels", "json"):
        assert absent not in flat
    assert ckpt.compare_manifest(m, ckpt.build_manifest(RunConfig(pp=2, schedule="gpipe", microbatches=8,
                                                                  hidden=64, iters=99), 2)) is None
