"""Which plain one-pass residual-add kernel beats torch's `x + y` (issue 33)? A sweep of simple designs against torch
and peerline's current kernel, graph-replayed device time, in one run of about 90 s on one GPU.

Candidates (residual_add_probe.cu, compiled with CuPy's NVRTC, launched on torch's current stream through
peerline.kernels.launch's pre-packed launcher, so they can be captured into CUDA graphs): 16-byte vectors, U in
{1, 2, 4, 8} chunks per thread with every load issued before the adds, blocks of 128, 256 or 512 threads, a grid of
one block per U x block chunks ("chunk", as torch's kernels) or a persistent grid-stride one ("persist": SMs x
resident blocks per SM), and cache hints: "plain" (ld/st.global), "nc" (ld.global.nc.L1::no_allocate),
"nc+cs" (the same loads, st.global.cs stores), "cs+cs" (ld.global.cs, st.global.cs). A chunk is 16 bytes of the
narrower operand; fp32+bf16 also tries "w16" designs, 16 bytes of the wider operand (the bf16 one then moves 8).

Anchors, in the same rotation: torch's `x + y` (a new output each call; the ratios are against it), torch.add(x, y,
out=o), and peerline's current kernel (peerline.kernels.elementwise.residual_add_forward). Timing is the kernels
suite's (peerline.bench.kernel_tools.common.graph_times): K calls captured into one graph over enough input sets that
they do not sit in L2, replays timed in rotation with an L2 scrub before each. GB/s counts x + y + out bytes.

Correctness: every candidate's output, written over a NaN-filled buffer, must equal torch's `x + y` bit for bit at
every size and at odd n with a scalar tail; a candidate that does not is reported WRONG and left out.

Pass 1 times every design at --pass1-mib (16 and 256 MiB of x) for each dtype; pass 2 times the best --keep designs
of each dtype (by their least ratio over pass 1, plus the best at each pass-1 size) at every size and dtype. The end:
the best design per size class and dtype, and the single design >= 1.0x torch at the most (dtype, size) cells.

    PYTHONPATH=$PWD python3 tools/gpu_probes/residual_add_probe.py [--json FILE] [--quick]
    (--device cpu checks the plumbing with torch's add on the CPU: candidates and peerline are skipped)

If a candidate launch cannot be captured into a CUDA graph, every list (torch's too) is timed eagerly instead: K calls
per timed repetition, CUDA events, the same rotation and scrub; the output says so on its `timing:` line.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from peerline.bench.benchkit import time_interleaved
from peerline.bench.kernel_tools.common import ROTATE_BYTES, graph_times, l2_scrub

SOURCE = Path(__file__).resolve().with_suffix(".cu")
DTYPES = {"fp32+fp32": (torch.float32, torch.float32), "bf16+bf16": (torch.bfloat16, torch.bfloat16),
          "fp32+bf16": (torch.float32, torch.bfloat16)}
CTYPE = {torch.float32: "float", torch.bfloat16: "bf16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # bitwise comparison views
HINTS = {"plain": (0, 0), "nc": (1, 0), "nc+cs": (1, 1), "cs+cs": (2, 1)}  # (LD, ST) of the .cu
UNROLLS, BLOCKS, GRIDS = (1, 2, 4, 8), (128, 256, 512), ("chunk", "persist")
SIZES_MIB = (1, 4, 16, 64, 256, 1024)
PASS1_MIB = (16, 256)
QUICK_SIZES_MIB, QUICK_PASS1_MIB = (1 / 64, 1 / 16), (1 / 16,)
TAIL_NS, QUICK_TAIL_NS = (5, 1_000_003, 3 * (1 << 20) + 7), (5, 1003)
TORCH, TORCH_OUT, PEERLINE = "torch x + y", "torch add(out=)", "peerline current"


@dataclass(frozen=True)
class Design:
    """One candidate kernel shape (the same design runs every dtype)."""

    unroll: int
    block: int
    grid: str  # "chunk" | "persist"
    hint: str  # a key of HINTS
    vec: str = "n16"  # "n16": 16 bytes of the narrower operand per chunk; "w16": of the wider one

    def label(self) -> str:
        return f"u{self.unroll}.b{self.block}.{self.grid}.{self.hint}" + (".w16" if self.vec == "w16" else "")

    def elems(self, xt: torch.dtype, yt: torch.dtype) -> int:
        """Elements per chunk."""
        sizes = (xt.itemsize, yt.itemsize)
        return 16 // (min(sizes) if self.vec == "n16" else max(sizes))

    def template(self, xt: torch.dtype, yt: torch.dtype) -> str:
        """The kernel's name expression in residual_add_probe.cu."""
        ld, st = HINTS[self.hint]
        ot = torch.promote_types(xt, yt)
        return (f"ra<{CTYPE[xt]}, {CTYPE[yt]}, {CTYPE[ot]}, {self.elems(xt, yt)}, {self.unroll}, {ld}, {st}, "
                f"{int(self.grid == 'persist')}>")


def all_designs(dtype_name: str, quick: bool) -> list[Design]:
    """Every design of the sweep for one dtype pair (w16 only where the operands differ in size)."""
    xt, yt = DTYPES[dtype_name]
    vecs = ("n16", "w16") if xt.itemsize != yt.itemsize else ("n16",)
    if quick:
        return [Design(u, 256, g, h, v) for u, g, h, v in itertools.product((1, 4), GRIDS, ("plain", "nc+cs"), vecs)]
    return [Design(u, b, g, h, v) for u, b, g, h, v in itertools.product(UNROLLS, BLOCKS, GRIDS, HINTS, vecs)]


# ---- compiling and launching the candidates ----


@dataclass
class Compiled:
    """The loaded candidate kernels of one device, by name expression."""

    kernels: dict[str, Any]
    sms: int
    device: torch.device
    occupancy: dict[tuple[str, int], int] = field(default_factory=dict)

    def resident(self, template: str, block: int) -> int:
        """Blocks of `block` threads resident per SM (the persistent grid's multiplier)."""
        key = (template, block)
        if key not in self.occupancy:
            import cupy

            fn = self.kernels[template].kernel.ptr
            self.occupancy[key] = max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, block, 0))
        return self.occupancy[key]


def compile_candidates(templates: list[str], device: torch.device) -> Compiled:
    """One NVRTC module holding every name expression (CuPy caches the cubin on disk)."""
    import cupy

    with cupy.cuda.Device(device.index):
        module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",), backend="nvrtc",
                                name_expressions=templates)
        kernels = {t: module.get_function(t) for t in templates}
        sms = cupy.cuda.runtime.getDeviceProperties(device.index)["multiProcessorCount"]
    return Compiled(kernels, sms, device)


def grid_of(design: Design, comp: Compiled, template: str, n: int, elems: int) -> int:
    """Blocks of one launch: one per U x block chunks, at most the resident blocks for a persistent grid."""
    need = max(1, -(-(n // elems) // (design.unroll * design.block)))
    if design.grid == "persist":
        return min(need, comp.sms * comp.resident(template, design.block))
    return need


def candidate_call(design: Design, comp: Compiled, x: torch.Tensor, y: torch.Tensor,
                   out: torch.Tensor) -> Callable[[], None]:
    """One launch of `design` computing out = x + y on torch's current stream (capturable: launch.py's launcher)."""
    from peerline.kernels import elementwise as ew

    for t in (x, y, out):
        assert t.is_contiguous() and t.data_ptr() % 16 == 0, "the candidates assume 16-byte aligned operands"
    n = x.numel()
    assert n < (1 << 31), "the candidates index with 32-bit integers"
    template = design.template(x.dtype, y.dtype)
    fn = comp.kernels[template]
    grid = grid_of(design, comp, template, n, design.elems(x.dtype, y.dtype))
    args = (x.data_ptr(), y.data_ptr(), out.data_ptr(), n)
    return lambda: ew.launch_raw(fn, grid, design.block, "pppq", args, comp.device)


# ---- one (dtype, size) cell: its inputs, correctness and timing ----


@dataclass
class Cell:
    """Input sets of one dtype pair and size, the preallocated outputs and torch's result of set 0."""

    dtype_name: str
    size_mib: float
    n: int
    rows: int
    hidden: int
    xs: list[torch.Tensor]
    ys: list[torch.Tensor]
    outs: list[torch.Tensor]
    ref: torch.Tensor

    @property
    def nbytes(self) -> int:
        xt, yt = DTYPES[self.dtype_name]
        return self.n * (xt.itemsize + yt.itemsize + torch.promote_types(xt, yt).itemsize)


def make_cell(dtype_name: str, size_mib: float, hidden: int, device: torch.device, quick: bool,
              n: int | None = None) -> Cell:
    """Rows x hidden inputs with x of about size_mib MiB (or exactly n elements, one row), in enough sets to
    rotate past L2 (as the kernels suite: at least ROTATE_BYTES of x, at most 64 sets)."""
    xt, yt = DTYPES[dtype_name]
    if n is None:
        rows = max(1, int(size_mib * (1 << 20)) // (hidden * xt.itemsize))
        n = rows * hidden
    else:
        rows, hidden = 1, n
    sets = 2 if quick else max(1, min(64, ROTATE_BYTES // (n * xt.itemsize)))
    xs = [torch.randn(rows, hidden, device=device).to(xt) for _ in range(sets)]
    ys = [torch.randn(rows, hidden, device=device).to(yt) for _ in range(sets)]
    outs = [torch.empty(rows, hidden, dtype=torch.promote_types(xt, yt), device=device) for _ in range(sets)]
    return Cell(dtype_name, size_mib, n, rows, hidden, xs, ys, outs, xs[0] + ys[0])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def check_candidate(design: Design, comp: Compiled, cell: Cell) -> bool:
    """The design's sum of set 0, written over NaN, equals torch's bit for bit."""
    cell.outs[0].fill_(float("nan"))
    candidate_call(design, comp, cell.xs[0], cell.ys[0], cell.outs[0])()
    return same_bits(cell.outs[0], cell.ref)


def anchor_lists(cell: Cell, with_peerline: bool) -> dict[str, list[Callable[[], object]]]:
    """torch's x + y, torch.add(out=) and (on a GPU) peerline's current kernel, one call per input set."""
    xs, ys, outs = cell.xs, cell.ys, cell.outs
    lists: dict[str, list[Callable[[], object]]] = {
        TORCH: [(lambda i=i: xs[i] + ys[i]) for i in range(len(xs))],
        TORCH_OUT: [(lambda i=i: torch.add(xs[i], ys[i], out=outs[i])) for i in range(len(xs))],
    }
    if with_peerline:
        from peerline.kernels import elementwise as ew

        lists[PEERLINE] = [(lambda i=i: ew.residual_add_forward(xs[i], ys[i])) for i in range(len(xs))]
    return lists


def peerline_correct(cell: Cell) -> bool:
    from peerline.kernels import elementwise as ew

    return same_bits(ew.residual_add_forward(cell.xs[0], cell.ys[0]), cell.ref)


def eager_times(call_lists: list[list[Callable[[], object]]], device: torch.device, reps: int) -> list[float]:
    """Milliseconds per call of each list, launched eagerly: all K calls of a list per timed repetition, in
    rotation with an L2 scrub before each (the fallback when candidates cannot be captured)."""
    runs = [(lambda calls=calls: [c() for c in calls]) for calls in call_lists]
    timings = time_interleaved(runs, warmup=2, reps=reps, device=device, before_each=l2_scrub(device))
    return [t.median_ms / len(calls) for t, calls in zip(timings, call_lists)]


def capture_works(comp: Compiled, device: torch.device) -> str | None:
    """None when a candidate launch captured into a torch CUDA graph replays to torch's result; else why not."""
    cell = make_cell("fp32+fp32", 1 / 16, 1536, device, quick=True)
    design = Design(4, 256, "chunk", "nc+cs")
    call = candidate_call(design, comp, cell.xs[0], cell.ys[0], cell.outs[0])
    try:
        call()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        cell.outs[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any capture failure means eager timing; the message is printed
        torch.cuda.synchronize(device)
        return f"{type(e).__name__}: {e}"
    return None if same_bits(cell.outs[0], cell.ref) else "the replayed graph's result differs from torch's"


# ---- the sweep ----


@dataclass
class Probe:
    """What the run knows: device, timing mode, compiled candidates, wrong designs and every row measured."""

    device: torch.device
    reps: int
    quick: bool
    verbose: bool
    json_path: Path | None
    comp: Compiled | None = None
    timing: str = "graph"
    wrong: dict[str, set[Design]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def times(self, call_lists: list[list[Callable[[], object]]]) -> list[float]:
        if self.timing == "graph":
            return graph_times(call_lists, self.device, self.reps)
        return eager_times(call_lists, self.device, self.reps)

    def save(self) -> None:
        """The rows so far (written after every cell, so a run cut short keeps what it measured)."""
        if self.json_path is not None:
            meta = {"device": device_name(self.device), "timing": self.timing, "reps": self.reps}
            self.json_path.write_text(json.dumps({"meta": meta, "rows": self.rows}, indent=1))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def measure_cell(probe: Probe, cell: Cell, designs: list[Design], pass_no: int) -> dict[str, float]:
    """Check and time the anchors and every design still correct on one cell; rows recorded, ratios returned
    (label -> torch ms / its ms)."""
    on_gpu = probe.device.type == "cuda"  # peerline's kernel runs on a GPU only
    wrong = probe.wrong.setdefault(cell.dtype_name, set())
    for d in designs:
        if d not in wrong and not check_candidate(d, probe.comp, cell):
            wrong.add(d)
            print(f"  WRONG {d.label()} at {cell.dtype_name} n={cell.n}: excluded", flush=True)
    live = [d for d in designs if d not in wrong]
    pl_ok = None
    if on_gpu:
        try:
            pl_ok = peerline_correct(cell)
        except Exception as e:  # noqa: BLE001 - the candidates are still worth timing without it
            print(f"  peerline current: failed ({type(e).__name__}: {e}); left out", flush=True)
    lists = anchor_lists(cell, with_peerline=pl_ok is not None)
    names = list(lists) + [d.label() for d in live]
    call_lists = list(lists.values()) + [
        [candidate_call(d, probe.comp, x, y, o) for x, y, o in zip(cell.xs, cell.ys, cell.outs)] for d in live]
    ms = dict(zip(names, probe.times(call_lists)))
    ratios = {k: ms[TORCH] / v for k, v in ms.items()}
    by_label = {d.label(): d for d in live}
    for name, t in ms.items():
        probe.rows.append({
            "pass": pass_no, "dtype": cell.dtype_name, "size_mib": cell.size_mib, "n": cell.n, "rows": cell.rows,
            "hidden": cell.hidden, "sets": len(cell.xs), "name": name, "ms": t,
            "gbps": cell.nbytes / (t * 1e-3) / 1e9, "ratio_vs_torch": ratios[name], "timing": probe.timing,
            "design": asdict(by_label[name]) if name in by_label else None,
            "correct": pl_ok if name == PEERLINE else True})
    print_cell(cell, ms, ratios, pass_no, probe, pl_ok)
    probe.save()
    return {k: v for k, v in ratios.items() if k in by_label}


def print_cell(cell: Cell, ms: dict[str, float], ratios: dict[str, float], pass_no: int, probe: Probe,
               pl_ok: bool | None) -> None:
    """GB/s and ratio to torch of the anchors and the candidates (pass 1: the best 10 unless --verbose)."""
    gbps = {k: cell.nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}
    print(f"== pass {pass_no} {cell.dtype_name} {cell.size_mib:g} MiB: n={cell.n} ({cell.rows}x{cell.hidden}), "
          f"{len(cell.xs)} sets, {probe.timing} timing ==")
    anchors = [k for k in (TORCH, TORCH_OUT, PEERLINE) if k in ms]
    cands = sorted((k for k in ms if k not in anchors), key=lambda k: -ratios[k])
    shown = cands if (pass_no == 2 or probe.verbose) else cands[:10]
    for k in anchors + shown:
        flag = " WRONG" if k == PEERLINE and pl_ok is False else ""
        print(f"  {k:<28} {gbps[k]:8.0f} GB/s  {ratios[k]:6.3f}x torch{flag}")
    if len(shown) < len(cands):
        print(f"  ... {len(cands) - len(shown)} more candidates (--verbose prints them; --json keeps them)")
    if cands:
        print(f"  best: {cands[0]} {ratios[cands[0]]:.3f}x torch")
    elif probe.comp is None:
        print("  candidates: skipped (no CuPy kernels on this device)")
    sys.stdout.flush()


def check_tails(probe: Probe, dtype_name: str, designs: list[Design], hidden: int) -> None:
    """Correctness only, at odd n (a scalar tail, and one n smaller than a chunk): wrong designs are excluded."""
    for n in (QUICK_TAIL_NS if probe.quick else TAIL_NS):
        cell = make_cell(dtype_name, 0, hidden, probe.device, quick=True, n=n)
        wrong = probe.wrong.setdefault(dtype_name, set())
        for d in designs:
            if d not in wrong and not check_candidate(d, probe.comp, cell):
                wrong.add(d)
                print(f"  WRONG {d.label()} at {dtype_name} n={n} (odd tail): excluded", flush=True)


def pick(pass1: dict[str, dict[float, dict[str, float]]], keep: int) -> list[str]:
    """Pass 2's designs: per dtype the `keep` best by their least ratio over pass 1's sizes, plus the best at each
    pass-1 size; their union, in order of first choice."""
    chosen: list[str] = []
    for by_size in pass1.values():
        measured = [r for r in by_size.values() if r]  # a failed cell has no ratios
        labels = set.intersection(*(set(r) for r in measured)) if measured else set()
        ranked = sorted(labels, key=lambda k: (-min(r[k] for r in measured), k))
        picks = ranked[:keep] + [max(r, key=r.get) for r in measured]
        chosen += [p for p in picks if p not in chosen]
    return chosen


# ---- the summary ----


def summarize(rows: list[dict[str, Any]], sizes: list[float]) -> None:
    """Best design per size class and dtype (pass 2), and the one design >= 1.0x torch at the most cells."""
    p2 = [r for r in rows if r["pass"] == 2]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in p2)]
    print("\n== best design per size class and dtype (pass 2; ratio to torch x + y; peerline current after /) ==")
    print((f"  {'MiB':>8}  " + "  ".join(f"{d:<36}" for d in dtypes)).rstrip())
    for s in sizes:
        cells = []
        for d in dtypes:
            here = [r for r in p2 if r["dtype"] == d and r["size_mib"] == s]
            cand = [r for r in here if r["design"] is not None]
            pl = next((r["ratio_vs_torch"] for r in here if r["name"] == PEERLINE), None)
            best = max(cand, key=lambda r: r["ratio_vs_torch"]) if cand else None
            text = f"{best['name']} {best['ratio_vs_torch']:.3f}" if best else "-"
            cells.append(f"{text} / {pl:.3f}" if pl is not None else text)
        print((f"  {s:>8g}  " + "  ".join(f"{c:<36}" for c in cells)).rstrip())
    single_design(p2)


def single_design(p2: list[dict[str, Any]]) -> None:
    """Designs by how many (dtype, size) cells they reach >= 1.0x torch at, then by their least ratio."""
    per: dict[str, list[tuple[float, str]]] = {}
    for r in p2:
        if r["design"] is not None:
            per.setdefault(r["name"], []).append((r["ratio_vs_torch"], f"{r['dtype']} {r['size_mib']:g} MiB"))
    if not per:
        print("SINGLE DESIGN: none (no candidate was timed)")
        return
    cells = max(len(v) for v in per.values())
    ranked = sorted(per, key=lambda k: (-sum(x >= 1.0 for x, _ in per[k]), -min(x for x, _ in per[k])))
    print(f"\n== designs by cells >= 1.0x torch (of {cells}), least ratio, geometric mean ==")
    for k in ranked[:8]:
        v = per[k]
        worst = min(v)
        geo = math.exp(sum(math.log(x) for x, _ in v) / len(v))
        print(f"  {k:<28} {sum(x >= 1.0 for x, _ in v):>2}/{len(v)}  min {worst[0]:.3f} ({worst[1]})  geo {geo:.3f}")
    top = per[ranked[0]]
    print(f"SINGLE DESIGN: {ranked[0]} >= 1.0x torch at {sum(x >= 1.0 for x, _ in top)}/{len(top)} cells, "
          f"min {min(top)[0]:.3f}x ({min(top)[1]})")


# ---- the run ----


def setup(probe: Probe, designs_by_dtype: dict[str, list[Design]]) -> None:
    """Compile the candidates and decide the timing mode; leaves probe.comp None where they cannot run."""
    if probe.device.type != "cuda":
        print("candidates: skipped on the CPU (the CuPy kernels need a CUDA device); timing torch's add only")
        probe.timing = "host (cpu)"
        return
    try:
        import cupy  # noqa: F401 - the candidates need it
    except ImportError as e:
        print(f"candidates: skipped ({e}); timing torch's add and peerline only")
        return
    templates = sorted({d.template(*DTYPES[k]) for k, ds in designs_by_dtype.items() for d in ds})
    t0 = time.perf_counter()
    probe.comp = compile_candidates(templates, probe.device)
    print(f"compiled {len(templates)} kernels in {time.perf_counter() - t0:.1f} s ({probe.comp.sms} SMs)")
    why = capture_works(probe.comp, probe.device)
    if why is not None:
        probe.timing = "eager"
        print(f"timing: EAGER (CUDA events over K launches per repetition; host launch cost included at small "
              f"sizes): a candidate could not be captured into a CUDA graph: {why}")
    else:
        print("timing: CUDA graphs (K calls per graph, replayed in rotation with an L2 scrub), as the kernels suite")


def run_cell(probe: Probe, dtype_name: str, size: float, hidden: int, designs: list[Design],
             pass_no: int) -> dict[str, float]:
    """measure_cell on fresh inputs, freeing them after; a cell that fails is reported and skipped."""
    t0 = time.perf_counter()
    try:
        cell = make_cell(dtype_name, size, hidden, probe.device, probe.quick)
        ratios = measure_cell(probe, cell, designs if probe.comp is not None else [], pass_no)
    except Exception as e:  # noqa: BLE001 - one failed cell (e.g. out of memory) must not end a one-shot run
        print(f"  FAILED pass {pass_no} {dtype_name} {size:g} MiB: {type(e).__name__}: {e}", flush=True)
        ratios = {}
    finally:
        if probe.device.type == "cuda":
            torch.cuda.synchronize(probe.device)
            torch.cuda.empty_cache()
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return ratios


def run(args: argparse.Namespace) -> int:
    """The whole probe on the parsed flags; 0 when it ran (wrong candidates are reported, not failures)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    quick = args.quick
    sizes = [float(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else list(
        QUICK_SIZES_MIB if quick else SIZES_MIB)
    pass1 = [float(s) for s in args.pass1_mib.split(",")] if args.pass1_mib else list(
        QUICK_PASS1_MIB if quick else PASS1_MIB)
    hiddens = [int(h) for h in args.hidden.split(",")]
    probe = Probe(device, 3 if quick and args.reps is None else (args.reps or 30), quick, args.verbose,
                  Path(args.json) if args.json else None)
    t_start = time.perf_counter()
    print(f"residual_add_probe on {device_name(device)}: sizes {sizes} MiB, pass 1 at {pass1} MiB, "
          f"keep {args.keep}, reps {probe.reps}, widths {hiddens}")
    designs = {k: all_designs(k, quick) for k in DTYPES}
    setup(probe, designs)
    # torch.cuda.graph's capture runs gc.collect() in some torch versions: with everything alive now frozen out of
    # the collector's reach, each of the hundreds of captures costs milliseconds, not tens of them
    gc.freeze()
    try:
        sweep(probe, designs, sizes, pass1, hiddens, args.keep)
    finally:
        gc.unfreeze()
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    probe.save()
    return 0


def sweep(probe: Probe, designs: dict[str, list[Design]], sizes: list[float], pass1: list[float], hiddens: list[int],
          keep: int) -> None:
    """Tail checks, pass 1 over every design, pass 2 over the picked ones, the summary."""
    if probe.comp is not None:
        for k, ds in designs.items():
            check_tails(probe, k, ds, hiddens[0])
    results: dict[str, dict[float, dict[str, float]]] = {}
    for k in DTYPES:
        for i, s in enumerate(pass1):
            results.setdefault(k, {})[s] = run_cell(probe, k, s, hiddens[i % len(hiddens)], designs[k], 1)
    chosen = pick(results, keep)
    print(f"\npass 2 designs ({len(chosen)}): {', '.join(chosen)}")
    by_label = {d.label(): d for ds in designs.values() for d in ds}
    kept = [by_label[c] for c in chosen]  # a w16 design on a same-size pair is its n16 twin's kernel, same label
    for i, s in enumerate(sizes):
        for k in DTYPES:
            run_cell(probe, k, s, hiddens[i % len(hiddens)], kept, 2)
    summarize(probe.rows, sizes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    first, _, rest = __doc__.partition("\n\n")  # the question as the description, the rest as the epilog
    ap = argparse.ArgumentParser(description=first, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=rest)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (default when there is one) or cpu (plumbing check: torch's add only)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few designs and reps: a smoke test")
    ap.add_argument("--sizes-mib", default=None, help=f"comma list of MiB of x for pass 2 (default {SIZES_MIB})")
    ap.add_argument("--pass1-mib", default=None, help=f"comma list of MiB of x for pass 1 (default {PASS1_MIB})")
    ap.add_argument("--hidden", default="1536,3072",
                    help="comma list of row widths, taken in turn by the sizes (held out from the suite's 8192)")
    ap.add_argument("--keep", type=int, default=4, help="designs per dtype carried from pass 1 to pass 2")
    ap.add_argument("--reps", type=int, default=None, help="timed replays per list (default 30; 3 with --quick)")
    ap.add_argument("--verbose", action="store_true", help="print every pass-1 candidate, not the best 10")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every row (both passes) to FILE")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
