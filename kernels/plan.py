"""Launch planning for the elementwise kernels: pure Python, no CUDA, so the CPU tests can check it.

Vocabulary (the same as elementwise.cu):
  E       elements per chunk: 16 bytes of the narrowest streamed operand, so every operand's chunk is whole
          16-byte vectors (bf16 present -> 8, all fp32 -> 4)
  head    scalar elements before the 16-byte-aligned body; every streamed pointer must become aligned after the
          same number of elements, else the op runs the scalar kernel
  tile    the chunks one block moves through shared memory per pipeline stage
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from peerline.choices import DTYPES as DTYPE_NAMES

VECTOR_BYTES = 16
# The default launch shape of the warp-specialized kernels (compile.py may override from the environment).
DEFAULT_WARPS = 8
DEFAULT_STAGES = 2
MAX_SMEM_PER_BLOCK = 227 * 1024  # sm_90's opt-in maximum of dynamic shared memory per block
# Bias-gradient partial sums (fp32) the vector backward may write before it falls back to the scalar kernel.
MAX_PARTIALS = 1 << 24


def chunk_elems(itemsizes: Sequence[int], vec: int = 1) -> int:
    """E: elements per chunk for operands of these element sizes (bytes); `vec` 16-byte vectors of the narrowest."""
    return vec * VECTOR_BYTES // min(itemsizes)


def tile_chunks(e: int, itemsizes: Sequence[int]) -> int:
    """Chunks per tile: 512 (4 per compute thread) unless a stage would pass 24 KiB, then 256."""
    return 512 if e * sum(itemsizes) <= 48 else 256


def common_head(addrs: Sequence[tuple[int, int]], e: int) -> int | None:
    """Smallest head h < E such that every (address, itemsize) is 16-byte aligned at element h, or None."""
    for h in range(e):
        if all((addr + h * size) % VECTOR_BYTES == 0 for addr, size in addrs):
            return h
    return None


def output_offset(base_addr: int, itemsize: int, head: int) -> int:
    """Offset (elements) into a fresh buffer at `base_addr` that makes element `head` 16-byte aligned, so an
    output shares the inputs' head and the op stays on the vector path for misaligned inputs."""
    per = VECTOR_BYTES // itemsize
    for off in range(per):
        if (base_addr + (off + head) * itemsize) % VECTOR_BYTES == 0:
            return off
    raise ValueError(f"itemsize {itemsize} cannot reach {VECTOR_BYTES}-byte alignment from address {base_addr:#x}")


@dataclass(frozen=True, slots=True)
class VectorPlan:
    """How one vector-path launch covers n elements."""

    head: int
    nchunks: int
    tail_start: int  # first element after the body
    ntiles: int
    grid: int


# A grid beyond the resident blocks pays only when it is many waves deep: with 1-4 waves the last one runs part
# full while the rest of the machine idles, and the persistent grid is faster (docs/benchmarks/kernels-history.md).
MIN_WAVES = 4


def vector_grid(ntiles: int, max_grid: int, rounds: int = 0) -> int:
    """Blocks of one vector launch over `ntiles` tiles.

    rounds 0: the persistent grid, min(max_grid, ntiles) blocks (max_grid = every block resident at once), tiles
    dealt round robin, so each block's share is fixed at launch. rounds r > 0: ceil(ntiles / r) blocks, so a block
    walks at most r tiles (r rounds of its pipeline) and the grid exceeds what is resident: the hardware then starts
    each further block on whichever SM frees a slot first, which evens out SMs that stream at different speeds (a
    fixed share makes the slowest SM the kernel's end). Only when that grid is at least MIN_WAVES waves of resident
    blocks; a shallower one gets the persistent grid (its partial last wave costs more than the balance gains).
    The kernel is the same either way (block b walks tiles b, b + gridDim.x, ...)."""
    grid = max(1, min(max_grid, ntiles))
    if rounds > 0:
        wide = -(-ntiles // rounds)
        if wide >= MIN_WAVES * max_grid:
            grid = wide
    return grid


def plan_vector(n: int, head: int | None, e: int, tiles: int, max_grid: int, rounds: int = 0) -> VectorPlan | None:
    """The vector plan, or None when there is no whole chunk to stream (the scalar kernel is then cheaper).
    `rounds`: see vector_grid."""
    if head is None or n - head < e:
        return None
    nchunks = (n - head) // e
    ntiles = -(-nchunks // tiles)
    return VectorPlan(head, nchunks, head + nchunks * e, ntiles, vector_grid(ntiles, max_grid, rounds))


def backward_grid(ntiles: int, hidden: int, tile_elems: int, max_grid: int,
                  max_partials: int = MAX_PARTIALS) -> int | None:
    """Grid of the vector backward: a multiple of hidden / gcd(hidden, tile_elems), so that grid * tile_elems is a
    multiple of `hidden` and every slot of a block stays in one column (per-thread bias sums, no atomics).
    None when that grid would be too large (then the scalar kernel runs)."""
    m = hidden // math.gcd(hidden, tile_elems)
    grid = max(1, min(max_grid, ntiles) // m) * m
    if grid > 4 * max_grid or grid * tile_elems > max_partials:
        return None
    return grid


def scalar_backward_threads(n: int, hidden: int, target: int) -> int:
    """Threads of the scalar backward: a multiple of `hidden` (so each thread's elements share a column), about
    `target` (or n, if smaller), at least `hidden`."""
    want = max(1, min(n, target))
    return hidden * -(-want // hidden)


def bias_vector_ok(hidden: int, head: int, e: int, bias_addr: int, bias_itemsize: int) -> bool:
    """Whether each chunk's E bias values are one aligned vector load: chunk columns are multiples of E."""
    width = e * bias_itemsize
    return hidden % e == 0 and head % e == 0 and bias_addr % min(VECTOR_BYTES, width) == 0


def simulate_bias_partials(n: int, hidden: int, head: int, e: int, tile_elems: int, grid: int,
                           values: Sequence[float]) -> list[float]:
    """A slow model of the vector backward's bias reduction, for the CPU tests: per-(block, slot) sums as the
    compute threads form them, then the column sums as pl_reduce forms them (head and tail added per column).
    Returns the per-column sums of `values` (length n)."""
    tile_chunks_ = tile_elems // e
    nchunks = (n - head) // e
    ntiles = -(-nchunks // tile_chunks_)
    part = [0.0] * (grid * tile_elems)
    for b in range(grid):
        for t in range(b, ntiles, grid):
            for j in range(tile_elems):
                i = t * tile_elems + j  # body element
                if i < nchunks * e:
                    part[b * tile_elems + j] += values[head + i]
    rows = grid * tile_elems // hidden
    out = [0.0] * hidden
    tail_start = head + nchunks * e
    for k in range(hidden):
        col = (head + k) % hidden
        s = sum(part[r * hidden + k] for r in range(rows))
        s += sum(values[i] for i in range(head) if i % hidden == col)
        s += sum(values[i] for i in range(tail_start, n) if i % hidden == col)
        out[col] = s
    return out


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """The launch shape of the warp-specialized kernels, tunable without editing the CUDA source.

    warps          compute warps per block (plus one loader and one storer warp)
    stages         shared-memory pipeline stages (2 = double buffering; 3-4 keep more loads in flight)
    tile_chunks    chunks per tile (one stage); 0 = the default rule (`tile_chunks`); must be a multiple of
                   32 x warps so every compute thread owns the same number of chunks
    blocks_per_sm  cap on resident blocks per SM for the persistent grid; 0 = as many as fit (occupancy)
    direct_store   compute warps store results from registers to global memory (no C buffers in shared memory;
                   the storer warp keeps only the scalar head and tail)
    vec            16-byte vectors per chunk of the narrowest operand (1 or 2: 32 contiguous bytes per lane)
    loader         0: the loader warp copies with cp.async, 16 bytes per lane (LDGSTS); 1: one lane issues a
                   cp.async.bulk per operand tile (TMA, UBLKCP; sm_90), completing on mbarriers (PL_LOADER)
    storer         0: the storer warp writes 16 bytes per lane; 1: one cp.async.bulk shared->global per tile
                   (TMA store; needs direct_store off) (PL_STORER)
    hint           cache hints for data used once: 0 none; 1 direct stores with st.global.cs; 2 also the bulk
                   loader's tiles with an L2 evict_first policy (PL_HINT; 1 needs direct_store, 2 also loader 1)
    rounds         0: persistent grid (SMs x resident blocks, tiles dealt round robin); r > 0: at most r tiles per
                   block, the grid as large as that needs (vector_grid), balanced by the hardware's block
                   scheduler. A grid field, not a kernel field (same cubin); the bias+GELU backward ignores it
                   (its per-block bias partial sums grow with the grid). Excludes blocks_per_sm.
    phi            0: Phi as the build says (compile.GELU, default phi_cdf_fast for bf16 results, phi_cdf_acc for
                   fp32); 1: the forward's bf16 results through phi_cdf_lite (degree-3 P, 7.8e-4 relative, two FMAs
                   fewer per element; PL_GELU 4 = compile.GELU_LITE). fp32 results and the backward are unchanged.
    """

    warps: int = DEFAULT_WARPS
    stages: int = DEFAULT_STAGES
    tile_chunks: int = 0
    blocks_per_sm: int = 0
    direct_store: bool = False
    vec: int = 1
    loader: int = 0
    storer: int = 0
    hint: int = 0
    rounds: int = 0
    phi: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.warps <= 30:
            raise ValueError(f"warps must be 1..30 (threads = 32 x (warps + 2) <= 1024), got {self.warps}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"stages must be 1..8, got {self.stages}")
        if self.tile_chunks < 0 or self.tile_chunks % (32 * self.warps) != 0:
            raise ValueError(f"tile_chunks must be 0 (default) or a multiple of 32 x warps = {32 * self.warps}, "
                             f"got {self.tile_chunks}")
        if self.blocks_per_sm < 0:
            raise ValueError(f"blocks_per_sm must be >= 0, got {self.blocks_per_sm}")
        if self.vec not in (1, 2):
            raise ValueError(f"vec must be 1 or 2, got {self.vec}")
        if self.loader not in (0, 1):
            raise ValueError(f"loader must be 0 (cp.async) or 1 (cp.async.bulk), got {self.loader}")
        if self.storer not in (0, 1):
            raise ValueError(f"storer must be 0 (st.global) or 1 (cp.async.bulk), got {self.storer}")
        if self.storer and self.direct_store:
            raise ValueError("storer 1 (TMA stores from the storer warp) needs direct_store off")
        if self.hint not in (0, 1, 2):
            raise ValueError(f"hint must be 0, 1 (streaming stores) or 2 (and evict-first loads), got {self.hint}")
        if self.hint and not self.direct_store:
            raise ValueError("hint 1/2 (st.global.cs) applies to direct stores: needs direct_store on")
        if self.hint == 2 and self.loader != 1:
            raise ValueError("hint 2 (evict-first bulk loads) needs loader 1")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0 (0 = persistent grid), got {self.rounds}")
        if self.phi not in (0, 1):
            raise ValueError(f"phi must be 0 (the build's Phi) or 1 (phi_cdf_lite for bf16 forward results), "
                             f"got {self.phi}")
        if self.rounds and self.blocks_per_sm:
            raise ValueError("rounds (a grid beyond the resident blocks) and blocks_per_sm (a cap on the resident "
                             "grid) exclude each other")

    def spec_fields(self) -> dict[str, int]:
        """The KernelSpec fields of this plan (tuning() without the grid keys GRID_KEYS)."""
        return {k: v for k, v in self.tuning().items() if k not in GRID_KEYS}

    def tuning(self) -> dict[str, int]:
        """Overrides for elementwise.TUNING (KernelSpec fields plus the grid keys blocks_per_sm and rounds); "gelu"
        only with phi 1 (else the build's PL_GELU stays, e.g. PEERLINE_KERNEL_GELU)."""
        gelu = {"gelu": GELU_LITE} if self.phi else {}
        return {"warps": self.warps, "stages": self.stages, "tile": self.tile_chunks,
                "direct": int(self.direct_store), "vec": self.vec, "loader": self.loader, "storer": self.storer,
                "hint": self.hint, **gelu, "blocks_per_sm": self.blocks_per_sm, "rounds": self.rounds}

    def label(self) -> str:
        """Short name, parseable by `parse_plan`: w8.s2.t0.b0.d0.v1 (plus .l1 / .o1 / .h1 / .r8 only where not 0,
        so the labels of earlier runs stay the same)."""
        return (f"w{self.warps}.s{self.stages}.t{self.tile_chunks}.b{self.blocks_per_sm}"
                f".d{int(self.direct_store)}.v{self.vec}" + (f".l{self.loader}" if self.loader else "")
                + (f".o{self.storer}" if self.storer else "") + (f".h{self.hint}" if self.hint else "")
                + (f".r{self.rounds}" if self.rounds else "") + (f".p{self.phi}" if self.phi else ""))


# tuning() keys that shape the grid, not the kernel build (KernelSpec has no such fields)
GRID_KEYS = ("blocks_per_sm", "rounds")
# compile.GELU_LITE (elementwise.cu PL_GELU 4), the KernelSpec gelu mode of phi 1 (plan.py imports no CUDA module)
GELU_LITE = 4


# Label letter -> LaunchPlan field, the one table that `label`'s output and `parse_plan` agree on.
PLAN_FIELDS = {"w": "warps", "s": "stages", "t": "tile_chunks", "b": "blocks_per_sm", "d": "direct_store", "v": "vec",
               "l": "loader", "o": "storer", "h": "hint", "r": "rounds", "p": "phi"}


def parse_plan(text: str) -> LaunchPlan:
    """A LaunchPlan from its label (fields may be omitted or reordered: 's3.d1' = 3 stages, direct stores)."""
    keys = PLAN_FIELDS
    fields: dict[str, int | bool] = {}
    for part in filter(None, text.strip().split(".")):
        key, val = part[0], part[1:]
        if key not in keys or not val.isdigit():
            raise ValueError(f"bad plan field {part!r} in {text!r}; expected e.g. w8.s3.t512.b2.d1.v1")
        fields[keys[key]] = bool(int(val)) if key == "d" else int(val)
    return LaunchPlan(**fields)  # type: ignore[arg-type]


def plan_grid_cap(sms: int, occupancy_blocks: int, blocks_per_sm: int) -> int:
    """Persistent grid size: SMs x resident blocks per SM, capped by the plan's blocks_per_sm (0 = no cap)."""
    per_sm = max(1, occupancy_blocks)
    if blocks_per_sm > 0:
        per_sm = min(per_sm, blocks_per_sm)
    return sms * per_sm


OP_NAMES = ("bias_gelu_fwd", "bias_gelu_bwd", "residual_add")


# Size class of a launch: "l2" when the bytes it moves (every input read once, every output written once) are at
# most L2_FRACTION x the device's L2 cache. There a plan can leave results in L2 for later write-back and beat a plan
# that streams at DRAM speed; the sweep puts the turn-over between 1.44 and 1.9 x L2 for residual add
# (docs/benchmarks/kernels-history.md).
SIZE_CLASSES = ("l2",)
L2_FRACTION = 1.5


def in_l2(bytes_moved: int, l2_bytes: int) -> bool:
    """Whether a launch moving `bytes_moved` bytes is in the "l2" size class on a device with `l2_bytes` of L2."""
    return 0 < l2_bytes and bytes_moved <= L2_FRACTION * l2_bytes


def parse_op_plans(text: str) -> dict[str, LaunchPlan]:
    """Per-op launch plans, as the sweep's best lines suggest them: "OP[:DTYPE][:l2]=PLAN,..." with OP one of
    OP_NAMES, DTYPE (x's) one of bf16, fp32 and ":l2" for launches whose bytes fit in L2 (in_l2); e.g.
    "residual_add=w8.s4.d1,bias_gelu_bwd:fp32=w4.s4.d1,residual_add:bf16:l2=w8.s2.t256.d1.l1.h2". Empty: none."""
    out: dict[str, LaunchPlan] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, label = item.partition("=")
        op, *rest = key.split(":")
        size = rest.pop() if rest and rest[-1] in SIZE_CLASSES else None
        dt = rest.pop() if rest else ""
        if not sep or op not in OP_NAMES or rest or (dt and dt not in DTYPE_NAMES):
            raise ValueError(f"bad kernel plan entry {item!r}; expected OP[:DTYPE][:l2]=PLAN with OP in "
                             f"{', '.join(OP_NAMES)}, DTYPE in {', '.join(DTYPE_NAMES)}")
        out[":".join(filter(None, (op, dt, size)))] = parse_plan(label)
    return out


def op_plan(plans: dict[str, LaunchPlan], op: str, dtype: str, l2: bool = False) -> LaunchPlan | None:
    """The plan for `op` with x of `dtype` (bf16 | fp32): with `l2` (the launch's bytes fit in L2) OP:DTYPE:l2, then
    OP:l2; then OP:DTYPE, then OP; else None (the default)."""
    keys = ([f"{op}:{dtype}:l2", f"{op}:l2"] if l2 else []) + [f"{op}:{dtype}", op]
    return next((plans[k] for k in keys if k in plans), None)
