"""SASS report of the elementwise kernels: LDGSTS (cp.async global->shared) in pl_main, or UBLKCP.S.G (cp.async.bulk)
for the bulk loader (PL_LOADER 1) and UBLKCP.G.S for the bulk storer (PL_STORER 1), registers, shared memory.

    python -m peerline.bench.kernel_tools.inspect_sass [--arch sm_90] [--out DIR]

Builds each KernelSpec's cubin with nvcc from the same source text NVRTC compiles (kernels/compile.py), then reads
it with `cuobjdump -sass` and `cuobjdump -res-usage`. Exit status 1 if a pl_main lacks its loader's copies (LDGSTS
for loader 0, UBLKCP for loader 1), 2 if the tools are missing. Needs nvcc and cuobjdump (the GPU machine has
both); no GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peerline.kernels import compile as kc

log = logging.getLogger(__name__)

SPECS = (
    kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", bias="float32"),
    kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32", bias="float32"),
    kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32"),
    kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32", bias="float32"),
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="bfloat16", out="float32"),
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16"),
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="float32", out="float32"),
    # the direct-store engine (compute warps STG.128 from registers), deeper pipeline: the sweep's main candidate
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16", direct=1, stages=4),
    kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", bias="float32", direct=1, stages=4),
    # the bulk loader (PL_LOADER 1: cp.async.bulk per tile, UBLKCP instead of LDGSTS), direct and through the storer
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16", direct=1, stages=4, loader=1),
    kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32", bias="float32", stages=3, loader=1),
    # TMA both ways: bulk loads and bulk stores from the storer warp (PL_STORER 1)
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16", stages=4, loader=1, storer=1),
)


def find_tool(name: str) -> str | None:
    """`name` on PATH, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda*/bin."""
    found = shutil.which(name)
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots += sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))
    for root in roots:
        if root and (Path(root) / "bin" / name).is_file():
            return str(Path(root) / "bin" / name)
    return None


def build_cubin(spec: kc.KernelSpec, nvcc: str, arch: str, workdir: Path) -> Path:
    src = workdir / "elementwise_full.cu"
    if not src.exists():
        src.write_text(kc.source_text())
    shape = f"w{spec.warps}s{spec.stages}t{spec.tile}d{spec.direct}v{spec.vec}g{spec.gelu}l{spec.loader}o{spec.storer}"
    cubin = workdir / f"op{spec.op}_{spec.x}_{spec.bias}_{spec.y}_{spec.out}_{shape}.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-o", str(cubin), str(src), *kc.nvrtc_options(spec)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return cubin


def ptx_of(source: Path, nvcc: str, arch: str = "sm_90") -> str:
    """The PTX nvcc makes of a standalone CUDA source file (RoPE, LayerNorm: the tests read their memory accesses)."""
    return subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-o", "-", str(source)], check=True, capture_output=True,
                          text=True, timeout=300).stdout


def ptx_entry(ptx: str, name: str) -> str:
    """The body of kernel `name` in PTX text: from its `.entry` line to the brace that closes it."""
    body = ptx[ptx.index(f".entry {name}("):]
    return body[:body.index("\n}\n")]


def split_functions(text: str, marker: str) -> dict[str, str]:
    """cuobjdump output -> {function name: its section}; sections start at lines like `<marker> pl_main`."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        m = re.match(rf"\s*{marker}\s*:?\s*(\S+?):?\s*$", line)
        if m:
            name = m.group(1)
            out[name] = ""
            continue
        if name is not None:
            out[name] += line + "\n"
    return out


def inspect(spec: kc.KernelSpec, nvcc: str, cuobjdump: str, arch: str, workdir: Path) -> dict:
    cubin = build_cubin(spec, nvcc, arch, workdir)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    funcs = split_functions(sass, "Function")
    usage = {}
    for fname, body in split_functions(res, "Function").items():
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", body)
        if m:
            usage[fname] = dict(zip(("registers", "stack", "static_smem", "local"), map(int, m.groups())))
    rows = {}
    for fname, body in funcs.items():
        rows[fname] = {
            "LDGSTS": len(re.findall(r"\bLDGSTS\.E", body)),  # the copies themselves (not LDGSTSBAR)
            "UBLKCP": len(re.findall(r"\bUBLKCP\.S\.G\b", body)),  # cp.async.bulk global->shared (bulk loader)
            "UBLKCP.G.S": len(re.findall(r"\bUBLKCP\.G\.S\b", body)),  # cp.async.bulk shared->global (storer)
            "LDS.128": len(re.findall(r"\bLDS\.128\b", body)),
            "STG.E.128": len(re.findall(r"\bSTG\.E\.128\b", body)),
            "LDL/STL": len(re.findall(r"\b(?:LDL|STL)\b", body)),
            **usage.get(fname, {}),
        }
    return {"spec": spec.label(), "arch": arch, "sass_pl_main": funcs.get("pl_main", ""),
            "dynamic_smem_bytes": spec.smem_bytes, "tile_chunks": spec.tile_chunks, "threads": spec.threads,
            "loader": spec.loader, "storer": spec.storer,
            "functions": rows}


def loader_copies_present(counts: dict, loader: int, storer: int = 0) -> bool:
    """The loader's asynchronous global->shared copies are in pl_main: LDGSTS for the cp.async loader (and no
    bulk loads), UBLKCP.S.G ("UBLKCP") for the bulk loader; and UBLKCP.G.S exactly when the storer is the bulk
    one."""
    if loader == 1:
        loads = counts.get("UBLKCP", 0) > 0
    else:
        loads = counts.get("LDGSTS", 0) > 0 and counts.get("UBLKCP", 0) == 0
    return loads and (counts.get("UBLKCP.G.S", 0) > 0) == (storer == 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", type=Path, default=None, help="write sass_report.json and the SASS of pl_main here")
    args = ap.parse_args(argv)
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    if not nvcc or not cuobjdump:
        print(f"inspect_sass: error: need nvcc and cuobjdump (found nvcc={nvcc}, cuobjdump={cuobjdump})",
              file=sys.stderr)
        return 2
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "elementwise_full.cu").write_text(kc.source_text())
        with ThreadPoolExecutor(max_workers=8) as pool:  # nvcc runs are independent
            reports = list(pool.map(lambda spec: inspect(spec, nvcc, cuobjdump, args.arch, Path(tmp)), SPECS))
        for rep in reports:
            main_fn = rep["functions"].get("pl_main", {})
            good = loader_copies_present(main_fn, rep["loader"], rep["storer"])
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} {rep['spec']:<62} pl_main: LDGSTS={main_fn.get('LDGSTS')} "
                  f"UBLKCP={main_fn.get('UBLKCP')} UBLKCP.G.S={main_fn.get('UBLKCP.G.S')} "
                  f"LDS.128={main_fn.get('LDS.128')} STG.E.128={main_fn.get('STG.E.128')} "
                  f"regs={main_fn.get('registers')} static_smem={main_fn.get('static_smem')}B(incl. 1 KiB reserved) "
                  f"dynamic_smem={rep['dynamic_smem_bytes']}B local={main_fn.get('local')} "
                  f"LDL/STL={main_fn.get('LDL/STL')}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for rep in reports:
            name = re.sub(r"[^A-Za-z0-9_]+", "_", rep["spec"]).strip("_")
            (args.out / f"sass_{name}.txt").write_text(rep.pop("sass_pl_main"))
        (args.out / "sass_report.json").write_text(json.dumps(reports, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
