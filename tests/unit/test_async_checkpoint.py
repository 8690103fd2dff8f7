"""--save-async on one process (resilience/async_checkpoint.py): host staging reused from save to save, a
background write that is the same verified checkpoint as a synchronous one and does not see later changes of the
tensors, a failed write as one line, the long-wait line, the store rounds of two ranks (done, failed), and the
save faults and the flag's check."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from peerline.distributed.config import ConfigError, ReportedElsewhere, RunConfig
from peerline.distributed.resilience import async_checkpoint as ac
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as store
from peerline.distributed.resilience.faults import Faults, FaultSpecError, parse_faults

pytestmark = pytest.mark.timeout(60)
MANIFEST = {"model": {"hidden": 8}}


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"model.layers.0.weight": torch.randn(64, 64), "model.layers.0.bias": torch.randn(64),
            "optim.layers.0.weight.step": torch.tensor(3.0)}


def _saver(root: Path, **kwargs) -> ac.AsyncSaver:
    return ac.AsyncSaver(str(root), 0, 1, torch.device("cpu"), MANIFEST, **kwargs)


def _load(root: Path, iteration: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    ckpt.load_checkpoint(root, MANIFEST, lambda shapes: target, iteration)
    return target


def test_staging_copies_and_reuses_its_buffers():
    staging = ac.HostStaging(torch.device("cpu"))
    src = _state()
    first = staging.stage(src)
    assert all(torch.equal(first[k], src[k]) and first[k].data_ptr() != src[k].data_ptr() for k in src)
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    src["model.layers.0.weight"].add_(1.0)
    again = staging.stage(src)
    assert {k: v.data_ptr() for k, v in again.items()} == ptrs  # the same buffers, refilled
    assert torch.equal(again["model.layers.0.weight"], src["model.layers.0.weight"])
    changed = {"model.layers.0.weight": torch.zeros(32, 64)}  # another shape, the other keys gone
    third = staging.stage(changed)
    assert list(third) == ["model.layers.0.weight"] and third["model.layers.0.weight"].shape == (32, 64)
    assert staging.nbytes() == 32 * 64 * 4
    staging.close()
    assert not staging.buffers


def test_background_write_is_the_checkpoint_of_the_boundary(tmp_path):
    """The write holds the tensors as they were at start(): later changes (training) are not in it."""
    gate = threading.Event()
    saver = _saver(tmp_path, after_write=lambda n: gate.wait(30))
    src = _state()
    want = {k: v.clone() for k, v in src.items()}
    job = saver.start(2, src)
    assert saver.in_flight and saver.poll() is None  # the writer waits at the gate
    for v in src.values():
        v.add_(100.0)  # "training goes on"
    assert store.iterations(tmp_path) == []  # nothing published while the write is in flight
    gate.set()
    assert saver.wait(print) == 2 and not saver.in_flight and saver.done == [job]
    assert job.stage_s >= 0 and job.write_s > 0 and job.error is None
    assert store.verify(tmp_path, 2, 0, MANIFEST) is None
    got = _load(tmp_path, 2, src)
    assert all(torch.equal(got[k], want[k]) for k in want)
    saver.close()


def test_keep_prunes_after_each_background_write(tmp_path):
    saver = _saver(tmp_path, keep=2)
    for n in (1, 2, 3):
        saver.start(n, _state(n))
        assert saver.wait(print) == n
    assert store.iterations(tmp_path) == [3, 2] and ckpt.latest_iteration(tmp_path) == 3


def test_a_failed_write_raises_one_line_and_publishes_nothing(tmp_path):
    def fail(n: int) -> None:
        raise OSError(5, f"fault injected: rank 0's write of checkpoint {n} fails")

    saver = _saver(tmp_path, after_write=fail)
    saver.start(4, _state())
    with pytest.raises(ckpt.CheckpointError) as e:
        saver.wait(print)
    assert str(e.value) == (f"cannot write checkpoint {tmp_path / 'iter_000004'} of iteration 4: [Errno 5] fault "
                            "injected: rank 0's write of checkpoint 4 fails")
    assert not saver.in_flight and store.iterations(tmp_path) == []
    assert (tmp_path / ".iter_000004.tmp").is_dir()  # removed by the next run (remove_leftovers)


def test_a_long_wait_is_said_once(tmp_path):
    gate = threading.Event()
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        gate.set()  # the writer goes on once the line is out: no timing in this test

    saver = _saver(tmp_path, after_write=lambda n: gate.wait(30), long_wait_s=0.0)
    saver.start(3, _state())
    assert saver.wait(say) == 3
    assert len(said) == 1 and said[0].startswith(
        "waiting for the background write of the checkpoint of iteration 3 to finish (started ")


class _Job:
    """A write's outcome as the rounds see it."""

    def __init__(self, iteration: int, finished: bool, error: str | None = None) -> None:
        self.iteration, self.error = iteration, error
        self.finished = threading.Event()
        if finished:
            self.finished.set()


def _round(outcomes: list[tuple[bool, str | None]], savers: list[ac.AsyncSaver]) -> list:
    """One round of two ranks (threads) over one store: each rank's (done, failed, why)."""
    got: list = [None, None]

    def run(r: int) -> None:
        got[r] = savers[r]._agree(_Job(7, *outcomes[r]))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_rounds_agree_on_done_and_on_a_failure():
    hash_store = dist.HashStore()
    savers = [ac.AsyncSaver("unused", r, 2, torch.device("cpu"), MANIFEST, store=hash_store) for r in range(2)]
    assert _round([(False, None), (False, None)], savers) == [(False, False, "")] * 2
    assert _round([(True, None), (False, None)], savers) == [(False, False, "")] * 2
    assert _round([(True, None), (True, None)], savers) == [(True, False, "")] * 2
    failed = _round([(False, None), (True, "cannot write checkpoint ck/iter_000007 of iteration 7: disk")], savers)
    line = "cannot write checkpoint ck/iter_000007 of iteration 7: disk (rank 1)"
    assert [f[1:] for f in failed] == [(True, line)] * 2
    assert not hash_store.check(["peerline/ckpt/7/1"])  # rank 0 deletes the rounds every rank is past


def test_poll_raises_on_rank_0_and_quietly_elsewhere():
    for rank, kind in ((0, ckpt.CheckpointError), (1, ReportedElsewhere)):
        saver = ac.AsyncSaver("unused", rank, 1, torch.device("cpu"), MANIFEST)
        saver.job = _Job(5, True, "cannot write checkpoint x")
        with pytest.raises(kind, match="^cannot write checkpoint x$"):
            saver.poll()
        assert not saver.in_flight


def test_save_faults_parse_and_fire(monkeypatch):
    slow, fail = parse_faults("slow-save:rank=1:iter=4:s=0.5;fail-save:rank=0:iter=4")
    assert (slow.kind, slow.rank, slow.iteration, slow.seconds) == ("slow-save", 1, 4, 0.5)
    faults = Faults([slow, fail])
    slept: list[float] = []
    monkeypatch.setattr(ac.time, "sleep", slept.append)  # faults.py's time module is the same object
    faults.before_iteration(1, None, 4)  # no boundary fault: save faults fire inside a write only
    faults.during_save(1, 4)
    faults.during_save(1, 2)
    assert slept == [0.5]
    with pytest.raises(OSError, match="fault injected: rank 0's write of checkpoint 4 fails"):
        faults.during_save(0, 4)
    for spec, needle in (("slow-save:rank=1:iter=4", "needs s=SECONDS"),
                         ("fail-save:stage=1:iter=4", "fail-save takes attempt, iter, rank")):
        with pytest.raises(FaultSpecError, match=needle):
            parse_faults(spec)


def test_save_async_needs_save():
    with pytest.raises(ConfigError, match="^--save-async needs --save DIR$"):
        RunConfig(save_async=True)
    assert RunConfig(save="ck", save_async=True).save_async
