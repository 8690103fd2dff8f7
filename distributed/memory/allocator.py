"""Device allocator settings: PyTorch's caching allocator or the stream-ordered cudaMallocAsync pool.

    configure_allocator("async", release_threshold=None)   # before torch is imported (see below)
    ... import torch, build the run ...
    apply_release_threshold(device)                         # after CUDA init: the pool keeps what it holds
    allocation_count(device)                                # device allocations seen so far

When PyTorch reads the backend: `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` is parsed when torch's CUDA
library loads (at `import torch`, a static initializer), and again when CUDA initialises; the two must agree or CUDA
initialisation fails with "Allocator backend parsed at runtime != allocator backend parsed at load time". So the
backend can only be chosen before `import torch` (or in the environment of the process). `configure_allocator`
therefore sets the variable when torch is not loaded yet, accepts a loaded torch whose backend already is the one
asked for, and otherwise raises one clear ConfigError. `kind=None` (a RunConfig or command line that names no
allocator) keeps whatever the environment or an earlier call chose and never conflicts: only an explicit choice
that differs from the loaded backend is an error. This module imports torch lazily, so a launcher can call
`configure_allocator` before its own `import torch` (peerline.distributed imports no torch at package level).

The release threshold: PyTorch sets the default pool's cudaMemPoolAttrReleaseThreshold to UINT64_MAX when it first
allocates on a device (keep everything), so our value must be set after that first allocation;
`apply_release_threshold` allocates a byte first, then sets it through CuPy (or cuda-bindings). With threshold 0 the
driver returns unused pool memory to the system at every synchronization, and the next iteration grows the pool
again.

Counting device allocations: the caching allocator counts its cudaMalloc calls (memory_stats "num_device_alloc").
The cudaMallocAsync backend counts nothing of the kind (its stats are the pool's reserved/used bytes), and its
allocations come from the pool without any cudaMalloc; what costs is the pool growing. For it,
`allocation_count` returns the number of times the pool's reserved memory was seen to grow between calls (at most
one per call: sample it once per iteration).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from peerline import overrides
from peerline.distributed.config import ALLOCATORS, ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENV = "PYTORCH_CUDA_ALLOC_CONF"
_BACKEND_NAME = {"caching": "native", "async": "cudaMallocAsync"}
_RELEASE_THRESHOLD = 4  # cudaMemPoolAttrReleaseThreshold
_RESERVED_MEM_CURRENT = 5  # cudaMemPoolAttrReservedMemCurrent
KEEP_ALL = 2**64 - 1  # UINT64_MAX: the pool never shrinks (PyTorch's own choice)

_chosen: dict[str, Any] = {"kind": None, "threshold": None}
_growth: dict[int, list[int]] = {}  # device -> [last reserved bytes, growths seen]


def alloc_conf_with_backend(conf: str, kind: str) -> str:
    """`conf` (a PYTORCH_CUDA_ALLOC_CONF value) with its backend entry replaced by the one for `kind`; the other
    entries (expandable_segments, max_split_size_mb, ...) are kept in order."""
    parts = [p.strip() for p in conf.split(",") if p.strip() and not p.strip().startswith("backend:")]
    if kind == "async":
        parts.insert(0, "backend:cudaMallocAsync")
        # expandable_segments is a caching-allocator option; the async backend rejects unknown combinations.
        parts = [p for p in parts if not p.startswith("expandable_segments")]
    return ",".join(parts)


def _loaded_backend() -> str | None:
    """The backend a loaded torch chose at import ('native' / 'cudaMallocAsync'), None without a CUDA build."""
    import torch

    try:
        return torch.cuda.get_allocator_backend()
    except (AttributeError, RuntimeError, AssertionError):  # a CPU-only build has no CUDA allocator
        return None


def configure_allocator(kind: str | None, release_threshold: int | None = None) -> None:
    """Choose the device allocator: 'caching' (PyTorch's native caching allocator) or 'async' (cudaMallocAsync
    pool). Must run before torch is imported, unless the environment already selected the same backend. None:
    no choice, keep the backend the environment (PYTORCH_CUDA_ALLOC_CONF) or an earlier call selected.
    `release_threshold` (bytes, async only) is applied later by `apply_release_threshold`; None keeps everything
    (or, with kind None, the threshold of an earlier call)."""
    if kind is None:
        if release_threshold is not None:
            if release_threshold < 0 or release_threshold > KEEP_ALL:
                raise ConfigError(f"--pool-release-threshold must be 0..2**64-1 bytes, got {release_threshold}")
            # Whether the backend is async is checked by apply_release_threshold, once CUDA runs.
            _chosen["threshold"] = release_threshold
        return
    if kind not in ALLOCATORS:
        raise ConfigError(f"unknown allocator {kind!r}; choose one of {', '.join(ALLOCATORS)}")
    if release_threshold is not None:
        if kind != "async":
            raise ConfigError("--pool-release-threshold applies to --allocator async only")
        if release_threshold < 0 or release_threshold > KEEP_ALL:
            raise ConfigError(f"--pool-release-threshold must be 0..2**64-1 bytes, got {release_threshold}")
    want = _BACKEND_NAME[kind]
    if "torch" in sys.modules:
        active = _loaded_backend()
        if active is not None and active != want:
            import torch

            when = "CUDA is already initialised" if torch.cuda.is_initialized() else "torch is already imported"
            setting = alloc_conf_with_backend("", kind) or "backend:native"
            raise ConfigError(
                f"--allocator {kind} must be chosen before torch is imported: {when} with the {active} allocator "
                f"(PyTorch reads {ENV} when it loads); set {ENV}={setting} in the environment instead")
        if active is None:
            log.info("allocator %s: this torch has no CUDA allocator; nothing to configure", kind)
    else:
        overrides.assign(ENV, alloc_conf_with_backend(overrides.get_str(ENV, ""), kind))
    _chosen.update(kind=kind, threshold=release_threshold)


def preconfigure_from_argv(argv: list[str], env_default: str = "PEERLINE_ALLOCATOR") -> str | None:
    """For a launcher, before its `import torch`: read --allocator / --pool-release-threshold from `argv` (default
    $PEERLINE_ALLOCATOR, else no choice: the environment's backend) and configure. Returns the error message
    instead of raising, so the launcher can print it as its one error line after its imports (a bad value is also
    caught later by RunConfig)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    # No --allocator and no $PEERLINE_ALLOCATOR: leave the environment's backend alone (None), not 'caching'.
    p.add_argument("--allocator", default=overrides.get(env_default))
    p.add_argument("--pool-release-threshold", type=int, default=None)
    try:
        known, _ = p.parse_known_args(argv)
        configure_allocator(known.allocator, known.pool_release_threshold)
    except ConfigError as exc:
        return str(exc)
    except SystemExit:  # argparse: a non-integer threshold; RunConfig's parser reports it
        return None
    return None


def active_allocator() -> str:
    """'caching' or 'async', as torch runs it (loads torch); 'none' without a CUDA build."""
    backend = _loaded_backend()
    if backend is None:
        return "none"
    return "async" if backend == "cudaMallocAsync" else "caching"


def _default_pool(index: int) -> tuple[Any, int]:
    """(runtime module, handle of the device's default memory pool), via CuPy, else cuda-bindings."""
    try:
        import cupy

        return cupy.cuda.runtime, cupy.cuda.runtime.deviceGetDefaultMemPool(index)
    except ImportError:
        pass
    from cuda.bindings import runtime as cudart

    err, pool = cudart.cudaDeviceGetDefaultMemPool(index)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaDeviceGetDefaultMemPool({index}) failed: {err}")
    return cudart, pool


def _pool_get(index: int, attr: int) -> int:
    rt, pool = _default_pool(index)
    if hasattr(rt, "memPoolGetAttribute"):  # CuPy
        return int(rt.memPoolGetAttribute(pool, attr))
    err, value = rt.cudaMemPoolGetAttribute(pool, rt.cudaMemPoolAttr(attr))
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemPoolGetAttribute failed: {err}")
    return int(value)


def _pool_set(index: int, attr: int, value: int) -> None:
    rt, pool = _default_pool(index)
    if hasattr(rt, "memPoolSetAttribute"):  # CuPy
        rt.memPoolSetAttribute(pool, attr, value)
        return
    (err,) = rt.cudaMemPoolSetAttribute(pool, rt.cudaMemPoolAttr(attr), rt.cuuint64_t(value))
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemPoolSetAttribute failed: {err}")


def apply_release_threshold(device: torch.device, threshold: int | None = None) -> int | None:
    """Set the default pool's release threshold of `device` (async backend; after CUDA init). `threshold` defaults
    to the one given to configure_allocator; None there too: nothing to do. Returns the value read back."""
    import torch

    value = _chosen["threshold"] if threshold is None else threshold
    if value is None or device.type != "cuda":
        return None
    if active_allocator() != "async":
        raise ConfigError("--pool-release-threshold needs --allocator async")
    torch.empty(1, device=device)  # torch's first allocation on the device sets the threshold to UINT64_MAX
    index = device.index if device.index is not None else torch.cuda.current_device()
    _pool_set(index, _RELEASE_THRESHOLD, int(value))
    got = _pool_get(index, _RELEASE_THRESHOLD)
    if got != int(value):
        raise RuntimeError(f"the pool's release threshold reads {got} after setting {value}")
    log.info("allocator async: release threshold of device %d's default pool set to %d bytes", index, got)
    return got


def allocation_count(device: torch.device | None = None) -> int:
    """Device memory acquisitions seen so far: cudaMalloc calls of the caching allocator (num_device_alloc); for
    the async backend, the pool growths seen between calls of this function (see the module docstring); 0 on the
    CPU."""
    import torch

    if device is not None and device.type != "cuda":
        return 0
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    stats = torch.cuda.memory_stats(device)
    if active_allocator() != "async":
        return int(stats.get("num_device_alloc", 0))
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    last = _growth.setdefault(index, [0, 0])
    if reserved > last[0]:
        last[1] += 1
    last[0] = reserved
    return last[1]


def allocator_stats(device: torch.device) -> dict[str, Any]:
    """Backend, allocation count (see allocation_count), reserved bytes now and at peak, release threshold."""
    import torch

    out: dict[str, Any] = {"allocator": active_allocator(), "device_allocs": allocation_count(device)}
    if device.type == "cuda" and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats(device)
        out["reserved_bytes"] = int(stats.get("reserved_bytes.all.current", 0))
        out["reserved_peak_bytes"] = int(stats.get("reserved_bytes.all.peak", 0))
        if out["allocator"] == "async":
            index = device.index if device.index is not None else torch.cuda.current_device()
            out["release_threshold"] = _pool_get(index, _RELEASE_THRESHOLD)
    return out

