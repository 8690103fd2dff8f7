"""The cheapest kernel launch from Python: arguments packed once, one driver call per launch.

A launch of elementwise.py caches everything but its pointers (plan.LaunchCache); what is left per call is to
write the new pointers into an `ArgPack` (ctypes values whose addresses form the `void**` that cuLaunchKernel reads)
and one driver call. Three ways to make that call, all on the same pre-packed arguments, so the host-cost bench
(bench/suites/hostcost.py) can compare them:

  "cuda-bindings"  cuda.bindings.driver.cuLaunchKernel with the address of the packed `void**` (no per-call packing)
  "ctypes"         libcuda's cuLaunchKernel through ctypes (no extra package)
  "cupy"           CuPy's RawKernel call (it packs numpy scalars per call), the launch path of earlier versions

`LAUNCHER` picks one ("auto": cuda-bindings when importable, else CuPy). The arguments are copied by the driver at
the launch, so one ArgPack per cached launch is reused call after call (one thread per process launches kernels).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

LAUNCHERS = ("auto", "cuda-bindings", "ctypes", "cupy")
# The launcher of every kernel of elementwise.py; the host-cost bench sets it to compare them.
LAUNCHER = "auto"
# ArgPack slot kinds: a device pointer, a 64-bit and a 32-bit signed integer, a 32-bit and a 64-bit float (the
# kernels' parameter types)
_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float, "d": ctypes.c_double}


class ArgPack:
    """A kernel's arguments as ctypes values and the `void**` array of their addresses, built once.

    `kinds` names each parameter: "p" pointer, "q" int64, "i" int32, "f" float32, "d" float64 (e.g. "pppqqq"
    for residual add's vector kernel). `set(i, v)` writes one value; `address` is what cuLaunchKernel takes as
    kernelParams."""

    __slots__ = ("kinds", "values", "params", "address")

    def __init__(self, kinds: str, values: Sequence[int] = ()) -> None:
        self.kinds = kinds
        self.values = [_CTYPES[k]() for k in kinds]
        self.params = (ctypes.c_void_p * len(kinds))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.params)
        for i, v in enumerate(values):
            self.values[i].value = v

    def current(self) -> tuple[int, ...]:
        """The packed values, in parameter order (the tests and the CuPy launcher read them)."""
        return tuple(v.value for v in self.values)


class Kernel:
    """One loaded kernel: the CuPy RawKernel (which keeps its module loaded) and its CUfunction handle, with the
    handle object each launcher wants made once."""

    __slots__ = ("raw", "handle", "_driver")

    def __init__(self, raw: Any, handle: int | None = None) -> None:
        self.raw = raw
        self.handle = int(raw.kernel.ptr) if handle is None else handle
        self._driver: Any = None

    def driver_handle(self) -> Any:
        if self._driver is None:
            from cuda.bindings import driver

            self._driver = driver.CUfunction(self.handle)
        return self._driver


def raw_stream(device_index: int) -> int:
    """The handle of torch's current stream on the device, without making a torch.cuda.Stream object."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return int(get(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context


def adopt_stream_context(stream: int) -> bool:
    """Make the context of `stream` current in this thread; True when it did.

    A thread that has not touched the driver yet (autograd's backward worker, for one) has no current context, and
    cuLaunchKernel then fails with CUDA_ERROR_INVALID_CONTEXT; the launchers call this once on that error and retry."""
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if stream and lib.cuStreamGetCtx(ctypes.c_void_p(stream), ctypes.byref(ctx)) == 0 and ctx.value:
        return lib.cuCtxSetCurrent(ctx) == 0
    dev = ctypes.c_int(torch.cuda.current_device())
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and lib.cuCtxSetCurrent(ctx) == 0


def _bindings_launcher() -> Callable[[Kernel, int, tuple[int, int], int, int, ArgPack], None]:
    from cuda.bindings import driver

    launch = driver.cuLaunchKernel

    def call(k: Kernel, grid: int, block: tuple[int, int], smem: int, stream: int, pack: ArgPack) -> None:
        (err,) = launch(k.driver_handle(), grid, 1, 1, block[0], block[1], 1, smem, stream, pack.address, 0)
        if getattr(err, "value", err) == INVALID_CONTEXT and adopt_stream_context(stream):
            (err,) = launch(k.driver_handle(), grid, 1, 1, block[0], block[1], 1, smem, stream, pack.address, 0)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")
    return call


def _ctypes_launcher() -> Callable[[Kernel, int, tuple[int, int], int, int, ArgPack], None]:
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    u = ctypes.c_uint
    launch.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int

    def call(k: Kernel, grid: int, block: tuple[int, int], smem: int, stream: int, pack: ArgPack) -> None:
        err = launch(k.handle, grid, 1, 1, block[0], block[1], 1, smem, stream, pack.address, None)
        if getattr(err, "value", err) == INVALID_CONTEXT and adopt_stream_context(stream):
            err = launch(k.handle, grid, 1, 1, block[0], block[1], 1, smem, stream, pack.address, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed: CUresult {err}")
    return call


def _cupy_launcher() -> Callable[[Kernel, int, tuple[int, int], int, int, ArgPack], None]:
    import cupy
    import numpy as np

    numpy_types = {"p": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32, "d": np.float64}
    streams: dict[int, Any] = {}

    def call(k: Kernel, grid: int, block: tuple[int, int], smem: int, stream: int, pack: ArgPack) -> None:
        s = streams.get(stream)
        if s is None:
            s = streams[stream] = cupy.cuda.ExternalStream(stream)
        args = tuple(numpy_types[t](v.value) for t, v in zip(pack.kinds, pack.values))
        k.raw((grid,), block, args, shared_mem=smem, stream=s)
    return call


_MAKERS = {"cuda-bindings": _bindings_launcher, "ctypes": _ctypes_launcher, "cupy": _cupy_launcher}
_made: dict[str, Callable[[Kernel, int, tuple[int, int], int, int, ArgPack], None]] = {}


def resolve(name: str) -> str:
    """'auto' -> 'cuda-bindings' when it is importable, else 'cupy'; ValueError for an unknown name."""
    if name not in LAUNCHERS:
        raise ValueError(f"unknown kernel launcher {name!r}; choose one of {', '.join(LAUNCHERS)}")
    if name == "auto":
        return "cuda-bindings" if importlib.util.find_spec("cuda.bindings") is not None else "cupy"
    return name


def launcher(name: str | None = None) -> Callable[[Kernel, int, tuple[int, int], int, int, ArgPack], None]:
    """The launch function of `name` (default LAUNCHER), made once per name."""
    key = resolve(LAUNCHER if name is None else name)
    fn = _made.get(key)
    if fn is None:
        fn = _made[key] = _MAKERS[key]()
    return fn


def launch(k: Kernel, grid: int, block: tuple[int, int], smem: int, stream: int, pack: ArgPack) -> None:
    """Launch `k` on `grid` blocks of `block` threads with the packed arguments, on the raw `stream`."""
    fn = _made.get(LAUNCHER)
    if fn is None:
        fn = _made[LAUNCHER] = launcher(LAUNCHER)
    fn(k, grid, block, smem, stream, pack)


# (kernel object id, kinds, thread) -> (the kernel object, kept alive; its Kernel; its ArgPack): a pack is reused
# only by the thread that made it (autograd's backward runs on a worker thread of its own)
_raw_packs: dict[tuple[int, str, int], tuple[Any, Kernel, ArgPack]] = {}


def launch_values(raw: Any, kinds: str, grid: int, block: int, values: Sequence[int | float], smem: int,
                  stream: int) -> None:
    """Launch a CuPy RawKernel with plain Python values, one per letter of `kinds` (ArgPack's: "p" pointer, "q"
    int64, "i" int32, "f" float32, "d" float64), through `launch`: the values written into a pack made once per
    kernel, kinds and thread, then one driver call (no numpy scalars, no CuPy per-call packing or stream wrapping)."""
    key = (id(raw), kinds, threading.get_ident())
    entry = _raw_packs.get(key)
    if entry is None or entry[0] is not raw:
        entry = _raw_packs[key] = (raw, Kernel(raw), ArgPack(kinds))
    _, kernel, pack = entry
    for slot, v in zip(pack.values, values):
        slot.value = v
    launch(kernel, grid, (block, 1), smem, stream, pack)
