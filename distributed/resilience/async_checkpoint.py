"""`--save-async`: a checkpoint written in the background while training goes on.

At a save point (an iteration boundary) `AsyncSaver.start` copies this rank's checkpoint tensors into host buffers
(`HostStaging`: kept from save to save; page-locked on a GPU, so the copy runs at the link's speed) and a writer
thread runs the same atomic save as a synchronous one from those copies (checkpoint.save_checkpoint: the temporary
folder, every file's SHA-256, the manifest last, the rename, `latest`; then --keep). Training goes on at once.

The writer never uses the training process group: torch.distributed.checkpoint's planning and the exchange of the
files' hashes run on a gloo group of their own, created at start-up (two threads driving one communicator deadlock
or mix their messages). The ranks learn the write's outcome together, through the process group's c10d store, at
launch boundaries (no device work, no host sync of the device):

    round k of the save of iteration n:  store.add("peerline/ckpt/<n>/<k>", 1 + W * done + W * (W + 1) * failed)
    the last arrival (total % W == 0) publishes the total; every rank reads how many ranks are done and failed

A round runs at every launch boundary while a write is in flight, so every rank learns at the same boundary that
the checkpoint is complete (rank 0 then says `saved checkpoint of iteration n`) or that some rank's write failed
(every rank raises the same one-line error there; rank 0 prints it). The next save, the end of training and a
preemption wait for the write in flight (`wait`: rounds until it is done; one line when that takes longer than
LONG_WAIT_S). A crash while a write is in flight leaves its `.iter_NNNNNN.tmp` folder, never a checkpoint that
verifies: resume takes the previous one, and the next run removes the folder.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peerline.distributed.config import ReportedElsewhere
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as ckpt_store

log = logging.getLogger(__name__)

PREFIX = "peerline/ckpt"
#: Seconds of waiting for a write in flight after which rank 0 says what it waits for (once per wait).
LONG_WAIT_S = 2.0
#: Seconds between two rounds while waiting.
POLL_S = 0.05
#: Timeout of the writer's gloo group: its collectives wait while the slowest rank writes its files.
WRITE_TIMEOUT_S = 3600.0
#: Completed writes kept for their figures (the bench reads them).
KEEP_DONE = 16
#: Staging buffers of at least this size are page-locked (smaller ones share pages with other allocations).
PIN_MIN_BYTES = 1 << 20


class HostStaging:
    """Host copies of one rank's checkpoint tensors by key, reused from save to save (same key, shape and dtype).
    On a GPU the large ones are page-locked with cudaHostRegister (exact sizes, unlike the caching host
    allocator's powers of two); a buffer that cannot be page-locked stays pageable (a slower copy, said once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.pinned: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, for cudaHostUnregister
        self.unpinned_bytes = 0
        self._said = False

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `tensors` into the host buffers (on a GPU: on the current stream, then synchronized); returns
        the buffers by key. The caller has waited for the iteration to finish."""
        for key in [k for k in self.buffers if k not in tensors]:
            self._drop(key)
        staged = {}
        for key, tensor in tensors.items():
            tensor = tensor.detach()
            buf = self.buffers.get(key)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                self._drop(key)
                buf = self.buffers[key] = self._new(tensor)
            buf.copy_(tensor, non_blocking=buf.data_ptr() in self.pinned)
            staged[key] = buf
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return staged

    def nbytes(self) -> int:
        """Bytes of all staging buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _new(self, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype)  # its own storage: DCP's writer copies views
        nbytes = buf.numel() * buf.element_size()
        if self.device.type != "cuda" or nbytes < PIN_MIN_BYTES:
            return buf
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err == 0:
            self.pinned[buf.data_ptr()] = buf
        else:
            self.unpinned_bytes += nbytes
            if not self._said:
                self._said = True
                log.warning("checkpoint staging: cudaHostRegister failed (CUDA error %d); some buffers stay "
                            "pageable, so their copy to the host is slower", err)
        return buf

    def _drop(self, key: str) -> None:
        buf = self.buffers.pop(key, None)
        if buf is not None and self.pinned.pop(buf.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def close(self) -> None:
        """Unpin and free every buffer (no write may be using them)."""
        for key in list(self.buffers):
            self._drop(key)


@dataclass
class Write:
    """One background write: the checkpoint's iteration, its staged tensors, and how it ended."""

    iteration: int
    tensors: dict[str, torch.Tensor]
    stage_s: float = 0.0
    write_s: float = 0.0
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event)


class AsyncSaver:
    """This rank's background checkpoint writer: at most one write in flight (see the module docstring)."""

    def __init__(self, root: str, rank: int, world: int, device: torch.device, manifest: Mapping[str, Any], *,
                 keep: int | None = None, group: Any = None, store: Any = None,
                 after_write: Callable[[int], None] | None = None, long_wait_s: float = LONG_WAIT_S) -> None:
        self.root, self.rank, self.world, self.device = Path(root), rank, world, device
        self.manifest, self.keep, self.group, self.store = dict(manifest), keep, group, store
        self.after_write = after_write
        self.long_wait_s = long_wait_s
        self.staging = HostStaging(device)
        self.job: Write | None = None
        self.done: list[Write] = []  # the last KEEP_DONE writes completed on every rank, oldest first
        self._round = 0
        self._previous: str | None = None

    @classmethod
    def create(cls, root: str, rank: int, world: int, device: torch.device, manifest: Mapping[str, Any],
               **kwargs: Any) -> AsyncSaver:
        """The writer of a run, with its gloo group and the store's rounds (collective: every rank, at start-up,
        before any write; no group and no store without a process group)."""
        group = store = None
        if dist.is_available() and dist.is_initialized():
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=WRITE_TIMEOUT_S))
            if world > 1:
                store = dist.distributed_c10d._get_default_store()
        return cls(root, rank, world, device, manifest, group=group, store=store, **kwargs)

    @property
    def in_flight(self) -> bool:
        """A write was started and not yet found complete on every rank."""
        return self.job is not None

    # -- writing --------------------------------------------------------------------------------------------------
    def start(self, iteration: int, tensors: Mapping[str, torch.Tensor]) -> Write:
        """Stage `tensors` (this rank's checkpoint of `iteration`) and write them in the background. Every rank
        calls it at the same boundary, with no write in flight (`wait` first)."""
        if self.job is not None:
            raise RuntimeError(f"the checkpoint of iteration {self.job.iteration} is still being written")
        t0 = time.perf_counter()
        job = Write(iteration, self.staging.stage(tensors))
        job.stage_s = time.perf_counter() - t0
        self.job = job
        threading.Thread(target=self._write, args=(job,), name=f"peerline-checkpoint-{iteration}",
                         daemon=True).start()
        return job

    def _write(self, job: Write) -> None:
        """The writer thread: the atomic save of `job` on the writer's group; never raises (the ranks learn the
        outcome in the rounds)."""
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            hook = (lambda: self.after_write(job.iteration)) if self.after_write is not None else None
            ckpt.save_checkpoint(self.root, self.rank, job.iteration, job.tensors, self.manifest,
                                 barrier=self._barrier, gather=self._gather, process_group=self.group,
                                 after_write=hook)
            if self.rank == 0:
                ckpt_store.prune(self.root, self.keep)
        except ckpt.CheckpointError as exc:
            job.error = str(exc)
        except BaseException as exc:  # noqa: BLE001 - a failure of the writer's group too: one line at a boundary
            job.error = str(ckpt.write_error(ckpt.iteration_dir(self.root, job.iteration), job.iteration, exc))
        finally:
            job.write_s = time.perf_counter() - t0
            job.finished.set()

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None or self.world == 1:
            return [obj]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def _barrier(self) -> None:
        if self.group is not None and self.world > 1:
            dist.barrier(group=self.group)

    # -- the rounds -----------------------------------------------------------------------------------------------
    def poll(self) -> int | None:
        """One round (every rank, at the same boundary, while a write is in flight): the iteration of the
        checkpoint when it is now complete on every rank, else None. A failed write raises on every rank alike:
        CheckpointError on rank 0, ReportedElsewhere (the same line, printed by rank 0) on the others."""
        job = self.job
        if job is None:
            return None
        done, failed, why = self._agree(job)
        if not done and not failed:
            return None
        self.job = None
        if failed:
            raise (ckpt.CheckpointError if self.rank == 0 else ReportedElsewhere)(why)
        job.tensors = {}  # the staging buffers are the next save's
        self.done = [*self.done[-(KEEP_DONE - 1):], job]
        return job.iteration

    def wait(self, say: Callable[[str], None]) -> int | None:
        """Rounds until the write in flight is complete on every rank (its iteration; None when none was in
        flight) or failed (raises, as `poll`). Says one line when it takes longer than `long_wait_s`."""
        job, t0, said = self.job, time.monotonic(), False
        while self.job is not None:
            finished = self.poll()
            if finished is not None:
                return finished
            if not said and time.monotonic() - t0 >= self.long_wait_s:
                said = True
                say(f"waiting for the background write of the checkpoint of iteration {job.iteration} to finish "
                    f"(started {time.monotonic() - job.started:.0f} s ago)")
            if job.finished.is_set():
                time.sleep(POLL_S)  # written here: the others are still writing
            else:
                job.finished.wait(POLL_S)
        return None

    def _agree(self, job: Write) -> tuple[bool, bool, str]:
        """(every rank done, some rank failed, the failure's line) of one round (module docstring)."""
        done = job.finished.is_set()
        failed = done and job.error is not None
        why = job.error if failed else ""
        if self.store is None:
            return done, failed, why
        self._round += 1
        key, w = f"{PREFIX}/{job.iteration}/{self._round}", self.world
        if failed:
            self.store.set(f"{key}/why", job.error + (f" (rank {self.rank})" if w > 1 else ""))
        total = self.store.add(key, 1 + w * int(done) + w * (w + 1) * int(failed))
        if total % w == 0:  # the last arrival: arrivals count 1..w, the flags add multiples of w
            self.store.set(f"{key}/total", str(total))
        self.store.wait([f"{key}/total"])
        n_failed, n_done = divmod(int(self.store.get(f"{key}/total")) // w - 1, w + 1)
        if n_failed:
            why = self.store.get(f"{key}/why").decode()
        if self.rank == 0 and self._previous is not None:  # every rank is past the previous round
            for suffix in ("", "/total", "/why"):
                self.store.delete_key(f"{self._previous}{suffix}")
        self._previous = key
        return n_done == w, n_failed > 0, why

    def close(self) -> None:
        """Free the staging buffers (no write in flight)."""
        if self.job is None:
            self.staging.close()
