"""Device memory shared between processes of one host through CUDA IPC, and the copies that write into it.

An IPC handle names one whole cudaMalloc allocation, and the importer gets the allocation's base address. Torch's
caching allocator (and CuPy's pool) hand out pieces of larger allocations, so memory meant for export is taken
straight from cudaMalloc here (`DeviceAllocation`) and wrapped as torch tensors without copying.

Copies into a peer's memory (`copy_peer`): cudaMemcpyPeerAsync, the eager path, or cudaMemcpyAsync with
cudaMemcpyDefault, which is the same copy-engine transfer through unified addressing and, unlike the former into an
IPC-mapped pointer, can be captured into a CUDA graph (the GPU transport tests replay such graphs).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:  # CuPy is an optional dependency (extras cuda12 / cuda13)
    from cupy.cuda import runtime as _rt
except ImportError:  # pragma: no cover - exercised on machines without CuPy
    _rt = None


def available() -> bool:
    """True when CuPy's CUDA runtime bindings are importable."""
    return _rt is not None


def _require() -> None:
    if _rt is None:
        raise ImportError("the copy-engine transport needs CuPy (pip install 'peerline[cuda13]')")


class _CudaArray:
    """Minimal __cuda_array_interface__ (version 2: no stream to synchronize) over raw device bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def wrap_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 torch tensor over `nbytes` of device memory at `ptr` (no copy; the caller keeps it alive)."""
    # Some torch versions place a __cuda_array_interface__ tensor on the current device and then move it to
    # `device` (a copy): make `device` current so the tensor aliases the memory, and check that it does.
    with torch.cuda.device(device):
        t = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    if t.data_ptr() != ptr:
        raise RuntimeError(f"torch copied device memory at {ptr:#x} instead of wrapping it")
    return t


def view_as(raw: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Typed view of `raw` (uint8) starting at byte `offset`, which must be aligned to the element size."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return raw[offset:offset + nbytes].view(dtype).view(shape)


class DeviceAllocation:
    """`nbytes` from cudaMalloc on `device`, exportable by IPC handle; freed by `free()` (not by GC, because a
    peer process may still map it: freeing is part of the transport's collective close)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        _require()
        self.device, self.nbytes = device, nbytes
        with torch.cuda.device(device):
            self.ptr: int = _rt.malloc(nbytes)
            self.tensor = wrap_bytes(self.ptr, nbytes, device)

    def handle(self) -> bytes:
        """The cudaIpcMemHandle_t (64 bytes) naming this allocation, to send to a peer."""
        with torch.cuda.device(self.device):
            return bytes(_rt.ipcGetMemHandle(self.ptr))

    def free(self) -> None:
        if self.ptr:
            self.tensor = None
            with torch.cuda.device(self.device):
                _rt.free(self.ptr)
            self.ptr = 0


class PeerMapping:
    """A peer's allocation opened in this process (cudaIpcOpenMemHandle, peer access enabled lazily). One handle
    can be opened once per process, so callers open each peer allocation exactly once and share the mapping."""

    def __init__(self, handle: bytes, device: torch.device) -> None:
        _require()
        self.device = device
        with torch.cuda.device(device):
            self.ptr: int = _rt.ipcOpenMemHandle(handle)

    def close(self) -> None:
        if self.ptr:
            with torch.cuda.device(self.device):
                _rt.ipcCloseMemHandle(self.ptr)
            self.ptr = 0


def copy_peer(dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: int,
              capture_safe: bool) -> None:
    """Copy `nbytes` from this process's `src` into the IPC-mapped `dst` on `stream` with the copy engine.

    capture_safe: cudaMemcpyAsync(cudaMemcpyDefault), capturable; else cudaMemcpyPeerAsync (device ordinals are
    this process's)."""
    if capture_safe:
        _rt.memcpyAsync(dst, src, nbytes, _rt.memcpyDefault, stream)
    else:
        _rt.memcpyPeerAsync(dst, dst_device, src, src_device, nbytes, stream)


def device_uuid(index: int) -> str:
    """A stable identity of a GPU across processes (device ordinals differ with CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def find_device(uuid: str) -> int | None:
    """This process's ordinal of the GPU with `uuid`, or None when it is not visible here."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None
