"""Event queries that a watching thread can make while the main thread is stuck inside CUDA.

`torch.cuda.Event.query()` keeps the GIL through its cudaEventQuery. A main thread blocked in the driver (a cudaFree
or a synchronize behind a stream that waits on a flag a dead peer never writes) can hold a lock such a query
needs, and a query waiting for it with the GIL held would stop every Python thread, the watchdog's included.
libcuda's cuEventQuery through ctypes releases the GIL for the call, so at worst the asking thread waits (the
watchdog bounds it with `run_bounded`) and the others run on.
"""

from __future__ import annotations

import ctypes
from typing import Any

from peerline.kernels.launch import INVALID_CONTEXT

SUCCESS = 0
NOT_READY = 600  # CUDA_ERROR_NOT_READY


class EventQuery:
    """`done(event)` for torch.cuda.Events of the context current where this is made (make it on the main thread);
    a thread without a current context takes that one."""

    def __init__(self, lib: Any = None) -> None:
        self._lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self._query = self._lib.cuEventQuery
        self._query.argtypes = [ctypes.c_void_p]
        self._query.restype = ctypes.c_int
        self._ctx = ctypes.c_void_p()
        self._lib.cuCtxGetCurrent(ctypes.byref(self._ctx))

    def done(self, event: Any) -> bool:
        """Whether the device has passed the event's last record (its `cuda_event` handle)."""
        handle = event.cuda_event
        err = self._query(handle)
        if err == INVALID_CONTEXT and self._ctx.value:
            self._lib.cuCtxSetCurrent(self._ctx)
            err = self._query(handle)
        if err == SUCCESS:
            return True
        if err == NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed: CUresult {err}")
