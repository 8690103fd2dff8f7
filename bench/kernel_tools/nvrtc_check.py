"""Compiles kernel specs with NVRTC itself (libnvrtc through ctypes), as CuPy does on the GPU machine, without a GPU.

    python -m peerline.bench.kernel_tools.nvrtc_check [--lib /path/libnvrtc.so.13] [--include DIR ...]

Why not only nvcc: NVRTC compiles device code only ("JIT mode") and rejects what nvcc accepts, e.g. a plain
`constexpr` function called from device code (a host function to NVRTC, which fails every build).
Finds libnvrtc from --lib, $PEERLINE_NVRTC_LIB, the nvidia-cuda-nvrtc wheel, or /usr/local/cuda*/lib64; CCCL's
headers (<cuda/pipeline>) from --include, $PEERLINE_CCCL_INCLUDE or /usr/local/cuda*/include/cccl. Exit 0 when every
spec compiles without a diagnostic, 1 on an error or warning, 2 when NVRTC or the headers are missing.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import os
import sys
from pathlib import Path

from peerline.kernels import compile as kc


def find_nvrtc() -> str | None:
    """Path of libnvrtc.so.* or None."""
    env = os.environ.get("PEERLINE_NVRTC_LIB")
    if env:
        return env if Path(env).is_file() else None
    cands = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        cands += sorted(glob.glob(os.path.join(root, "cu1*", "lib", "libnvrtc.so.*")))
        cands += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so.*")))
    cands += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
    cands = [c for c in cands if "builtins" not in c and "alt" not in c]
    return cands[0] if cands else None


def find_includes() -> list[str]:
    """Include directories for CCCL (<cuda/pipeline>) and the CUDA headers next to it."""
    env = os.environ.get("PEERLINE_CCCL_INCLUDE")
    if env:
        return [env]
    for cccl in sorted(glob.glob("/usr/local/cuda*/include/cccl"), reverse=True):
        return [cccl, str(Path(cccl).parent)]
    return []


def compile_spec(lib: ctypes.CDLL, spec: kc.KernelSpec, includes: list[str], arch: str = "sm_90") -> tuple[int, str]:
    """(nvrtcResult, log) of one spec, with the options compile.py passes plus the architecture and includes."""
    src = kc.source_text().encode()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"elementwise.cu", 0, None, None)
    if rc != 0:
        return rc, "nvrtcCreateProgram failed"
    try:
        opts = [o.encode() for o in (*kc.nvrtc_options(spec), f"-arch={arch}", *(f"-I{d}" for d in includes))]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        return rc, buf.value.decode(errors="replace").strip()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load(path: str) -> ctypes.CDLL:
    """libnvrtc, with its builtins library (same folder) findable."""
    folder = str(Path(path).parent)
    os.environ["LD_LIBRARY_PATH"] = folder + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    for b in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
        if "alt" not in b:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)  # dlopen'ed by name later: preload it from this folder
            break
    return ctypes.CDLL(path)


# One of each engine path: cp.async loader with the storer, direct stores, the bulk loader both ways, the bulk
# storer, 16 warps, every op, both GELU result types.
SPECS = (
    kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", bias="float32", warps=8, stages=2, tile=0, direct=0, vec=1,
                  loader=0),
    kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32", bias="float32", warps=16, stages=3, tile=0, direct=1, vec=1,
                  loader=0),
    kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32", bias="float32", warps=8, stages=2, tile=0, direct=0, vec=1,
                  loader=1),
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16", warps=8, stages=4, tile=0,
                  direct=1, vec=1, loader=1),
    kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="float32", out="float32", warps=8, stages=3, tile=0,
                  direct=0, vec=1, loader=1, storer=1),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=None)
    ap.add_argument("--include", action="append", default=None)
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    path = args.lib or find_nvrtc()
    includes = args.include or find_includes()
    if not path or not includes:
        sys.stderr.write(f"nvrtc_check: error: need libnvrtc (found {path}) and CCCL headers (found {includes})\n")
        return 2
    lib = load(path)
    ok = True
    for spec in SPECS:
        rc, text = compile_spec(lib, spec, includes, args.arch)
        good = rc == 0 and not text
        ok &= good
        sys.stdout.write(f"{'PASS' if good else 'FAIL'} {spec.label()}{'' if good else ': ' + text[-1500:]}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
