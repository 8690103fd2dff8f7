"""Run-time compilation of kernels/elementwise.cu through CuPy's NVRTC, cached per device and op.

A `KernelSpec` names one op with fixed element types; it becomes macro definitions for elementwise.cu. The header
ws_pipeline.cuh is pasted into the source before compiling, so CuPy's on-disk cache (keyed by the source text and
the options) can never return a kernel built from an older header. CuPy adds its bundled CCCL headers
(<cuda/pipeline>) to the include path and compiles for the current device's architecture (`-arch=sm_XX`, a
cubin), so the same code runs on H100 and H200 and is cached per architecture. CuPy is imported only here and
only when a kernel is first needed on a GPU.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peerline import overrides
from peerline.kernels import plan

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent
SOURCE = "elementwise.cu"
HEADER = "ws_pipeline.cuh"
# Tuning knobs for experiments. The design default is 8 compute warps with double buffering: 8 warps stream faster
# than 4 and a third stage gains nothing at the default tile (docs/benchmarks/kernels-history.md).
COMPUTE_WARPS = overrides.get_int("PEERLINE_KERNEL_WARPS", plan.DEFAULT_WARPS)
STAGES = overrides.get_int("PEERLINE_KERNEL_STAGES", plan.DEFAULT_STAGES)
# The rest of the launch shape (plan.LaunchPlan documents each): 0 / 0 / 1 are the design default.
TILE = overrides.get_int("PEERLINE_KERNEL_TILE", 0)
DIRECT = overrides.get_int("PEERLINE_KERNEL_DIRECT", 0)
VEC = overrides.get_int("PEERLINE_KERNEL_VEC", 1)
LOADER = overrides.get_int("PEERLINE_KERNEL_LOADER", 0)  # 0 cp.async (LDGSTS), 1 cp.async.bulk (sm_90)
STORER = overrides.get_int("PEERLINE_KERNEL_STORER", 0)  # 0 st.global per lane, 1 cp.async.bulk per tile
# How bias+GELU evaluates Phi (elementwise.cu PL_GELU): GELU_EXACT normcdff everywhere; GELU_FAST (default) the
# A&S 7.1.26 form on MUFU for bf16 results (3.5e-5) and its fp32 refit phi_cdf_acc for fp32 results (< 1e-6);
# GELU_FIRST the plain 0.5 (1 + erff) for bf16 results (normcdff for fp32), kept for comparisons; GELU_ACC
# phi_cdf_acc everywhere; GELU_LITE as GELU_FAST but the forward's bf16 results through phi_cdf_lite (degree-3 P,
# 7.8e-4; plan field p1).
GELU_EXACT, GELU_FAST, GELU_FIRST, GELU_ACC, GELU_LITE = 0, 1, 2, 3, 4
GELU = overrides.get_int("PEERLINE_KERNEL_GELU", GELU_FAST)

OP_BIAS_GELU_FWD, OP_BIAS_GELU_BWD, OP_RESIDUAL_ADD = 1, 2, 3
CTYPES = {"float32": "float", "bfloat16": "pl::bf16_t"}
ITEMSIZE = {"float32": 4, "bfloat16": 2}

# CUfunction_attribute values (cuda.h)
_ATTR_SHARED_SIZE_BYTES = 1
_ATTR_LOCAL_SIZE_BYTES = 3
_ATTR_NUM_REGS = 4
_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One op with its element types, by torch dtype name ("float32" | "bfloat16")."""

    op: int
    x: str
    bias: str = "float32"  # ops 1, 2
    y: str = "float32"  # op 3
    out: str = "float32"  # op 3
    warps: int = COMPUTE_WARPS  # compute warps per block
    stages: int = STAGES  # shared-memory stages (2 = double buffering)
    gelu: int = GELU  # Phi: GELU_EXACT | GELU_FAST | GELU_FIRST | GELU_ACC | GELU_LITE (elementwise.cu PL_GELU)
    tile: int = TILE  # chunks per tile; 0 = plan.tile_chunks' rule
    direct: int = DIRECT  # 1 = compute warps store to global memory (ws_pipeline.cuh PL_DIRECT_STORE)
    vec: int = VEC  # 16-byte vectors per chunk of the narrowest operand (PL_VEC)
    loader: int = LOADER  # 0: cp.async 16 B per lane (LDGSTS); 1: cp.async.bulk per tile (UBLKCP) (PL_LOADER)
    storer: int = STORER  # 0: st.global 16 B per lane; 1: cp.async.bulk shared->global per tile (PL_STORER)
    hint: int = 0  # cache hints for data used once: 0 none, 1 st.global.cs, 2 also evict-first bulk loads (PL_HINT)

    def __post_init__(self) -> None:
        for name in (self.x, self.bias, self.y, self.out):
            if name not in CTYPES:
                raise ValueError(f"unsupported dtype {name!r} for a peerline kernel; supported: {', '.join(CTYPES)}")
        if self.gelu not in (GELU_EXACT, GELU_FAST, GELU_FIRST, GELU_ACC, GELU_LITE):
            raise ValueError(f"unknown gelu mode {self.gelu}")
        if self.op not in (OP_BIAS_GELU_FWD, OP_BIAS_GELU_BWD, OP_RESIDUAL_ADD):
            raise ValueError(f"unknown op {self.op}")
        self.launch_plan()  # the launch-shape checks live in one place: LaunchPlan's constructor
        if self.tile_chunks % (32 * self.warps):
            raise ValueError(f"tile of {self.tile_chunks} chunks is not a multiple of 32 x {self.warps} compute warps")
        if self.smem_bytes > plan.MAX_SMEM_PER_BLOCK:
            raise ValueError(f"{self.label()}: {self.smem_bytes} bytes of shared memory per block "
                             f"(> {plan.MAX_SMEM_PER_BLOCK}); use fewer stages or a smaller tile")

    def launch_plan(self) -> plan.LaunchPlan:
        """The spec's launch shape as a LaunchPlan (its constructor checks it)."""
        return plan.LaunchPlan(warps=self.warps, stages=self.stages, tile_chunks=self.tile,
                               direct_store=bool(self.direct), vec=self.vec, loader=self.loader, storer=self.storer,
                               hint=self.hint, phi=int(self.gelu == GELU_LITE))

    @property
    def streamed_itemsizes(self) -> tuple[int, ...]:
        """Element sizes of the operands that go through shared memory (A, B, C)."""
        if self.op == OP_BIAS_GELU_FWD:
            return (ITEMSIZE[self.x], ITEMSIZE[self.x])
        if self.op == OP_BIAS_GELU_BWD:
            return (ITEMSIZE[self.x],) * 3
        return (ITEMSIZE[self.x], ITEMSIZE[self.y], ITEMSIZE[self.out])

    @property
    def threads(self) -> int:
        """Threads per block of pl_main: loader warp + compute warps + storer warp."""
        return 32 * (self.warps + 2)

    @property
    def e(self) -> int:
        """Elements per chunk (as elementwise.cu computes it)."""
        if self.op == OP_RESIDUAL_ADD:
            return plan.chunk_elems((ITEMSIZE[self.x], ITEMSIZE[self.y]), self.vec)
        return plan.chunk_elems((ITEMSIZE[self.x],), self.vec)

    @property
    def tile_chunks(self) -> int:
        if self.tile:
            return self.tile
        # the rule was made for 1 vector per chunk: about the same stage bytes for vec = 2, but at least one chunk
        # per compute thread (a whole multiple of them)
        threads = 32 * self.warps
        want = plan.tile_chunks(self.e // self.vec, self.streamed_itemsizes) // self.vec
        return max(threads, want // threads * threads)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of pl_main: STAGES x [A | B | C] ([A | B] with direct stores)."""
        sizes = self.streamed_itemsizes[:-1] if self.direct else self.streamed_itemsizes
        return self.stages * self.tile_chunks * self.e * sum(sizes)

    def defines(self) -> tuple[str, ...]:
        return (f"-DPL_OP={self.op}", f"-DPL_TX={CTYPES[self.x]}", f"-DPL_TBIAS={CTYPES[self.bias]}",
                f"-DPL_TY={CTYPES[self.y]}", f"-DPL_TOUT={CTYPES[self.out]}",
                f"-DPL_TILE_CHUNKS={self.tile_chunks}", f"-DPL_COMPUTE_WARPS={self.warps}",
                f"-DPL_STAGES={self.stages}", f"-DPL_GELU={self.gelu}", f"-DPL_DIRECT_STORE={self.direct}",
                f"-DPL_VEC={self.vec}", f"-DPL_LOADER={self.loader}", f"-DPL_STORER={self.storer}",
                f"-DPL_HINT={self.hint}")

    def label(self) -> str:
        names = {1: "bias_gelu_fwd", 2: "bias_gelu_bwd", 3: "residual_add"}
        types = f"x={self.x},bias={self.bias}" if self.op != OP_RESIDUAL_ADD else f"x={self.x},y={self.y}"
        return f"{names[self.op]}[{types}] {self.launch_plan().label()}"


def source_text() -> str:
    """elementwise.cu with ws_pipeline.cuh pasted in place of its #include."""
    src = (KERNEL_DIR / SOURCE).read_text()
    if f'#include "{HEADER}"' not in src:
        raise RuntimeError(f"{SOURCE} no longer includes {HEADER}")
    return paste_includes(src, KERNEL_DIR)


_INCLUDE = re.compile(r'^[ \t]*#include "([^"]+)"[^\n]*$', re.M)


def paste_includes(text: str, folder: Path) -> str:
    """`text` with each `#include "NAME"` of a file in `folder` replaced by that file's text (once per file; a pasted
    file's own includes too). CuPy keys its build cache on the source text, so a header's change must be in it;
    <system> includes stay for NVRTC."""
    pasted: set[str] = set()

    def paste(match: re.Match) -> str:
        name = match.group(1)
        if not (folder / name).is_file():
            return match.group(0)
        if name in pasted:
            return ""
        pasted.add(name)
        return _INCLUDE.sub(paste, (folder / name).read_text())

    return _INCLUDE.sub(paste, text)


# compute-sanitizer runs set this: its hazard reports then name source lines (of source_text()), not bare PCs.
LINEINFO = overrides.get("PEERLINE_KERNEL_LINEINFO") == "1"


def nvrtc_options(spec: KernelSpec) -> tuple[str, ...]:
    extra = ("-lineinfo",) if LINEINFO else ()
    return ("-std=c++17", f"--include-path={KERNEL_DIR}", *spec.defines(), *extra)


@dataclass
class CompiledOp:
    """The loaded kernels of one spec on one device, with what a launch needs to know."""

    spec: KernelSpec
    device_index: int
    main: Any
    scalar: Any
    reduce: Any | None
    sms: int
    blocks_per_sm: int
    attributes: dict[str, int]
    flat: Any | None = None  # residual add only: pl_flat, the one-pass vector kernel

    @property
    def max_grid(self) -> int:
        """Persistent grid: every block resident at once."""
        return self.sms * max(1, self.blocks_per_sm)

    def grid_cap(self, blocks_per_sm: int) -> int:
        """Persistent grid with at most `blocks_per_sm` resident blocks per SM (0: as many as fit)."""
        return plan.plan_grid_cap(self.sms, self.blocks_per_sm, blocks_per_sm)


def _attributes(cupy: Any, fn: Any) -> dict[str, int]:
    get = cupy.cuda.driver.funcGetAttribute
    handle = fn.kernel.ptr  # RawKernel.kernel is the loaded cupy Function; .ptr is its CUfunction
    return {"registers": get(_ATTR_NUM_REGS, handle), "static_smem_bytes": get(_ATTR_SHARED_SIZE_BYTES, handle),
            "local_bytes": get(_ATTR_LOCAL_SIZE_BYTES, handle)}


@functools.cache
def load_kernel(source: Path, name: str, device_index: int) -> tuple[Any, int]:
    """(CuPy RawKernel, its CUfunction) of the `extern "C"` kernel `name` in a standalone CUDA source file (the
    runtime's small kernels: distributed/data/counter.py, distributed/cudagraph/loop.py), built by NVRTC for the
    device's architecture and loaded on it, its local headers pasted in (paste_includes). Cached: the RawKernel keeps
    the module, and so the CUfunction, loaded."""
    import cupy  # GPU path only

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=paste_includes(source.read_text(), source.parent), options=("-std=c++17",),
                                backend="nvrtc")
        kernel = module.get_function(name)
        return kernel, kernel.kernel.ptr  # RawKernel.kernel: the loaded cupy Function (loads it on this device)


@functools.cache
def get_op(spec: KernelSpec, device_index: int) -> CompiledOp:
    """Compile (first call per device architecture; CuPy caches on disk too), load and configure one op."""
    import cupy  # GPU path only

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source_text(), options=nvrtc_options(spec), backend="nvrtc")
        main = module.get_function("pl_main")
        scalar = module.get_function("pl_scalar")
        reduce = module.get_function("pl_reduce") if spec.op == OP_BIAS_GELU_BWD else None
        flat = module.get_function("pl_flat") if spec.op == OP_RESIDUAL_ADD else None
        drv = cupy.cuda.driver
        # More than 48 KiB of dynamic shared memory needs an opt-in; ask for the whole carveout, since these
        # kernels use L1 only for the (small) bias.
        # RawKernel.kernel is the loaded cupy Function; its .ptr is the CUfunction the driver calls take.
        drv.funcSetAttribute(main.kernel.ptr, _ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.smem_bytes)
        drv.funcSetAttribute(main.kernel.ptr, _ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        blocks = drv.occupancyMaxActiveBlocksPerMultiprocessor(main.kernel.ptr, spec.threads, spec.smem_bytes)
        sms = cupy.cuda.runtime.getDeviceProperties(device_index)["multiProcessorCount"]
        attrs = _attributes(cupy, main)
        attrs.update(dynamic_smem_bytes=spec.smem_bytes, threads=spec.threads, blocks_per_sm=blocks)
    if blocks < 1:
        raise RuntimeError(f"{spec.label()}: pl_main cannot be resident ({attrs})")
    log.info("compiled %s on cuda:%d: %s", spec.label(), device_index, attrs)
    return CompiledOp(spec, device_index, main, scalar, reduce, sms, blocks, attrs, flat)


def _warm_one(spec: KernelSpec, device_index: int) -> str:
    """Compile one spec into CuPy's on-disk cache (a worker process of `warm_compile`)."""
    import cupy

    with cupy.cuda.Device(device_index):
        # get_function compiles (and stores the cubin in the disk cache) as get_op's first lookup does
        cupy.RawModule(code=source_text(), options=nvrtc_options(spec), backend="nvrtc").get_function("pl_main")
    return spec.label()


def warm_compile(specs: list[KernelSpec], device_index: int, workers: int) -> int:
    """NVRTC-compile many specs in parallel processes (about 1 s of CPU each), so the later `get_op` calls of this
    process only load cubins from CuPy's disk cache. Returns how many compiled; failures are logged and left to
    `get_op` (which raises them properly)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if workers <= 1 or len(specs) <= 1:
        return 0
    done = 0
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(specs)), mp_context=ctx) as ex:
            for fut in [ex.submit(_warm_one, s, device_index) for s in specs]:
                try:
                    fut.result(timeout=120)
                    done += 1
                except Exception as e:  # noqa: BLE001 - reported, get_op raises it again in this process
                    log.warning("parallel compile failed: %s", e)
    except Exception as e:  # noqa: BLE001 - the pool itself (e.g. no /dev/shm): compile serially later
        log.warning("parallel compile unavailable: %s", e)
    return done
