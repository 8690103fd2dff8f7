"""CUDA stream memory operations on 32-bit flag words: wait until a word equals a value, write a value.

These are the driver API's cuStreamWaitValue32 / cuStreamWriteValue32 (through `cuda.bindings.driver`). They run
in stream order on the GPU without a kernel and without the host, work on IPC-mapped memory of another process,
and can be captured into CUDA graphs (the GPU transport tests replay such graphs). Since CUDA 12 they need no
kernel-module option ("the V2 APIs are available by default on all platforms"), so there is no attribute to check
first.

A write is preceded by a memory fence (the default flag, with __threadfence_system() semantics): everything the
stream wrote before it, a peer copy included, is visible to whoever observes the new value.

Caution (CUDA's own warning): ordering made with these operations is invisible to CUDA. A stream blocked in a
wait blocks only itself, provided streams do not share a hardware queue: keep CUDA_DEVICE_MAX_CONNECTIONS at its
default (8) or above (streams.py asks for 32); `check_connections()` warns otherwise. And CUDA loads kernels
lazily (CUDA_MODULE_LOADING=LAZY): a kernel's first launch may synchronize the context, so a first launch while a
stream of the same process sits in a wait that only later work releases can deadlock (CUDA C++ Programming Guide,
Lazy Loading); launch such kernels once before (the GPU tests do). The runtime's first iteration is exposed in
principle; CUDA_MODULE_LOADING=EAGER removes the risk at start-up cost.

`FlagOps.batch` issues several of these operations with ONE cuStreamBatchMemOp call ("the operations are enqueued
in the order they appear in the array"; CUDA driver API, Stream Memory Operations), which the driver documents as
avoiding "some performance overhead in both the API call and the device execution". A graph captures it as one
batch-memop node (CU_GRAPH_NODE_TYPE_BATCH_MEM_OP, the node type single wait/write operations become too). If the
driver refuses a batch (`probe_batch`), FlagOps falls back to one call per operation.

Pre-packed batches: each distinct operation tuple is packed once into a C array of `BatchMemOpParams` (the
CUstreamBatchMemOpParams union of cuda.h, 48 bytes) and issued by libcuda's cuStreamBatchMemOp_v2 through ctypes
with that array's address: no per-call conversion of a Python list of cuda-bindings structs (which copies each
element into a fresh C array per call). `probe_packed` checks the packing once at set-up (a packed write, read
back); where it fails, or libcuda lacks the symbol, batches go through cuda-bindings as before.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from peerline import overrides
from peerline.kernels.launch import INVALID_CONTEXT, adopt_stream_context

log = logging.getLogger(__name__)

try:  # cuda-bindings is an optional dependency (extras cuda12 / cuda13)
    from cuda.bindings import driver as _cu
except ImportError:  # pragma: no cover - exercised on machines without CUDA Python
    _cu = None

_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced write
MAX_BATCH = 255  # cuStreamBatchMemOp: "count ... must be less than 256"
OP_WAIT_32 = 1  # CU_STREAM_MEM_OP_WAIT_VALUE_32
OP_WRITE_32 = 2  # CU_STREAM_MEM_OP_WRITE_VALUE_32
PROBE_SENTINEL = 0x5EED  # the value `probe_packed` writes and reads back


class BatchMemOpParams(ctypes.Structure):
    """One CUstreamBatchMemOpParams of cuda.h as a wait or write of a 32-bit value: the union's waitValue /
    writeValue member (operation, address, value, flags, alias; the two share one layout), padded to the union's 48
    bytes (`pad[6]`)."""

    _fields_ = [("operation", ctypes.c_uint32), ("_pad0", ctypes.c_uint32), ("address", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("_pad1", ctypes.c_uint32),
                ("alias", ctypes.c_uint64), ("_pad2", ctypes.c_uint64)]


if ctypes.sizeof(BatchMemOpParams) != 48:  # pragma: no cover - the union's size on every 64-bit ABI
    raise ImportError(f"BatchMemOpParams is {ctypes.sizeof(BatchMemOpParams)} bytes, expected 48")


def pack_ops(ops: tuple[tuple[str, int, int], ...]) -> ctypes.Array:
    """`ops` [("wait" | "write", addr, value)] as a C array of BatchMemOpParams: a wait is WAIT_VALUE_32 with the
    EQ flag, a write WRITE_VALUE_32 with the default (fenced) flag."""
    array = (BatchMemOpParams * len(ops))()
    for entry, (action, addr, value) in zip(array, ops):
        if action == "wait":
            entry.operation, entry.flags = OP_WAIT_32, _WAIT_EQ
        elif action == "write":
            entry.operation, entry.flags = OP_WRITE_32, _WRITE_DEFAULT
        else:
            raise ValueError(f"unknown flag operation {action!r}")
        entry.address, entry.value = addr, value
    return array


def _libcuda_batch() -> Callable[[int, int, int, int], int] | None:
    """libcuda's cuStreamBatchMemOp_v2 (stream, count, params address, flags) -> CUresult, or None where it is not
    loadable (the v1 symbol needs a kernel-module option: never used)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuStreamBatchMemOp_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """True when cuda.bindings is importable."""
    return _cu is not None


def _require() -> None:
    if _cu is None:
        raise ImportError("the copy-engine transport needs cuda-bindings (pip install 'peerline[cuda13]')")


def _check(result: object, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")


class FlagOps:
    """Stream memory operations with the driver handles cached: the hot path issues several per message, and
    building CUstream / CUdeviceptr objects each time would cost more than the call itself."""

    def __init__(self) -> None:
        _require()
        self._streams: dict[int, object] = {}
        self._ptrs: dict[int, object] = {}
        self._batches: dict[tuple[tuple[str, int, int], ...], list] = {}  # op tuple -> CUstreamBatchMemOpParams
        self.batching = True  # one cuStreamBatchMemOp per group of operations; False after a failed probe
        # op tuple -> (packed array, its address): the pre-packed path, while `packed_call` is set
        self._packed: dict[tuple[tuple[str, int, int], ...], tuple[ctypes.Array, int]] = {}
        self.packed_call = _libcuda_batch()
        self._wait_eq = int(_cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value)
        if self._wait_eq != _WAIT_EQ:  # defensive: the enum value is part of the ABI, but check once
            raise RuntimeError(f"unexpected CU_STREAM_WAIT_VALUE_EQ = {self._wait_eq}")

    def _stream(self, handle: int) -> object:
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = _cu.CUstream(handle)
        return s

    def _ptr(self, addr: int) -> object:
        p = self._ptrs.get(addr)
        if p is None:
            p = self._ptrs[addr] = _cu.CUdeviceptr(addr)
        return p

    def wait_eq(self, stream: int, addr: int, value: int) -> None:
        """Block `stream` (a cudaStream_t as int) until the 32-bit word at `addr` equals `value`."""
        _check(_cu.cuStreamWaitValue32(self._stream(stream), self._ptr(addr), value, _WAIT_EQ),
               "cuStreamWaitValue32")

    def write(self, stream: int, addr: int, value: int) -> None:
        """Write `value` to the 32-bit word at `addr` once the work queued before on `stream` is done."""
        _check(_cu.cuStreamWriteValue32(self._stream(stream), self._ptr(addr), value, _WRITE_DEFAULT),
               "cuStreamWriteValue32")

    def _params(self, ops: tuple[tuple[str, int, int], ...]) -> list:
        params = self._batches.get(ops)
        if params is None:
            params = []
            for action, addr, value in ops:
                p = _cu.CUstreamBatchMemOpParams()
                if action == "wait":
                    p.operation = _cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32
                    p.waitValue.operation = p.operation  # the union's tag, also the struct's first field
                    p.waitValue.address = self._ptr(addr)
                    p.waitValue.value = value
                    p.waitValue.flags = _WAIT_EQ
                elif action == "write":
                    p.operation = _cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
                    p.writeValue.operation = p.operation
                    p.writeValue.address = self._ptr(addr)
                    p.writeValue.value = value
                    p.writeValue.flags = _WRITE_DEFAULT
                else:
                    raise ValueError(f"unknown flag operation {action!r}")
                params.append(p)
            self._batches[ops] = params
        return params

    def batch(self, stream: int, ops: tuple[tuple[str, int, int], ...]) -> None:
        """Issue `ops` [("wait" | "write", addr, value)] on `stream`, in order: one cuStreamBatchMemOp when
        batching is on (the parameter array is built once per distinct tuple and cached), else one call each."""
        if len(ops) == 1 or not self.batching:
            for action, addr, value in ops:
                (self.wait_eq if action == "wait" else self.write)(stream, addr, value)
            return
        if len(ops) > MAX_BATCH:
            raise ValueError(f"{len(ops)} operations in one batch; at most {MAX_BATCH}")
        if self.packed_call is not None:
            hit = self._packed.get(ops)
            if hit is None:
                array = pack_ops(ops)
                hit = self._packed[ops] = (array, ctypes.addressof(array))
            err = self.packed_call(stream, len(ops), hit[1], 0)
            if err == INVALID_CONTEXT and adopt_stream_context(stream):  # a thread with no current context yet
                err = self.packed_call(stream, len(ops), hit[1], 0)
            if err:
                raise RuntimeError(f"cuStreamBatchMemOp_v2 failed: CUresult {err}")
            return
        _check(_cu.cuStreamBatchMemOp(self._stream(stream), len(ops), self._params(ops), 0), "cuStreamBatchMemOp")

    def probe_packed(self, stream: int, addr: int, value: int, read: Callable[[], int],
                     sync: Callable[[], None]) -> bool:
        """Check the pre-packed path once, outside any capture: a packed batch writes PROBE_SENTINEL twice to the
        word at `addr` (which holds `value` and nobody else writes yet), `read()` must see it after `sync()`, then
        the word gets `value` back through cuda-bindings. A refusal or a wrong word turns the packed path off.
        Returns whether it stays on."""
        if self.packed_call is None or not self.batching:
            return False
        reason = ""
        try:
            self.batch(stream, (("write", addr, PROBE_SENTINEL), ("write", addr, PROBE_SENTINEL)))
            sync()
            got = read()
            if got != PROBE_SENTINEL:
                reason = f"the word read {got:#x}, not {PROBE_SENTINEL:#x}"
        except RuntimeError as exc:
            reason = str(exc)
        finally:
            self.write(stream, addr, value)
            sync()
        if reason:
            log.warning("pre-packed cuStreamBatchMemOp unusable (%s): batches go through cuda-bindings", reason)
            self.packed_call = None
            self._packed.clear()
        return self.packed_call is not None

    def probe_batch(self, stream: int, addr: int, value: int) -> bool:
        """Try one batch (two writes of `value` to the word at `addr`, which must already hold it) on `stream`
        outside any capture; turn batching off if the driver refuses. Returns whether batching stays on."""
        try:
            _check(_cu.cuStreamBatchMemOp(self._stream(stream), 2,
                                          self._params((("write", addr, value), ("write", addr, value))), 0),
                   "cuStreamBatchMemOp")
        except RuntimeError as exc:
            log.warning("cuStreamBatchMemOp unusable (%s): one driver call per flag operation", exc)
            self.batching = False
        return self.batching

    def forget(self) -> None:
        """Drop cached handles (after the memory they name was freed)."""
        self._streams.clear()
        self._ptrs.clear()
        self._batches.clear()
        self._packed.clear()


def check_connections() -> None:
    """Warn when CUDA_DEVICE_MAX_CONNECTIONS is so low that a blocked wait could stall unrelated streams."""
    value = overrides.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is not None and value.isdigit() and int(value) < 4:
        log.warning("CUDA_DEVICE_MAX_CONNECTIONS=%s: streams share hardware queues, so a stream waiting for a "
                    "flag can stall the compute stream; unset it (default 8) for the copy-engine transport", value)
