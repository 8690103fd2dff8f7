"""Helpers for the CPU tests of the CUDA kernels.

- `build`: a kernel source built as host C++ (g++) for the multi-tensor optimizer kernels: the CUDA keywords and
  intrinsics defined away, no floating-point contractions, and each kernel wrapped in a host function that runs
  every block and every thread one after another. Their threads share nothing, so running them in turn is the
  kernels' meaning.
- `declared_kinds` and `record_launches`: what a kernel declares and what its launch packs, for the launch-packing
  tests.
- `SYNTAX_PRELUDE`: stand-ins for the CUDA names the standalone kernels use, under which g++ checks their syntax
  (test_kernel_sources.py)."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import torch

PRELUDE = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct PlDim { unsigned int x = 0, y = 0, z = 0; };
static PlDim blockIdx, threadIdx, blockDim, gridDim;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
"""


# C parameter type -> launch.ArgPack letter (every pointer is "p")
_KINDS = {"int": "i", "long long": "q", "float": "f", "double": "d"}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_longlong, "f": ctypes.c_float, "d": ctypes.c_double}


def param_kinds(params: str) -> str:
    """The ArgPack letters of a C parameter list ("const float* lr, int n, ..."): "p" for every pointer."""
    kinds = []
    for param in params.split(","):
        words = param.replace("__restrict__", "").replace("*", " * ").replace("const", "").split()[:-1]
        kinds.append("p" if words[-1] == "*" else _KINDS[" ".join(words)])
    return "".join(kinds)


def declared_kinds(source: str, name: str) -> str:
    """The ArgPack letters of the `extern "C"` kernel `name`'s parameters, from its declaration in `source`: what a
    launch must pack, in order and typed alike."""
    return param_kinds(re.search(rf'extern "C" __global__ void {name}\((.*?)\)\s*{{', source, re.S).group(1))


def wrapper_argtypes(params: str) -> list:
    """The ctypes argtypes of a grid_wrapper made with `params`: those parameters, then the thread count."""
    return [_CTYPES[k] for k in param_kinds(params)] + [ctypes.c_uint]


def record_launches(monkeypatch) -> list[tuple[str, str, tuple]]:
    """Replace the standalone kernels' loading and launching (compile.load_kernel, elementwise.launch_raw) by a
    recorder: each launch appends (kernel name, ArgPack letters, values)."""
    from peerline.kernels import compile, elementwise

    calls: list[tuple[str, str, tuple]] = []
    monkeypatch.setattr(compile, "load_kernel", lambda source, name, index: (name, 0))
    monkeypatch.setattr(elementwise, "launch_raw",
                        lambda kernel, grid, block, kinds, values, device: calls.append((kernel, kinds, values)))
    return calls

SYNTAX_PRELUDE = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __launch_bounds__(...)
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct PlDim { unsigned int x = 0, y = 0, z = 0; };
static PlDim blockIdx, threadIdx, blockDim, gridDim;
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
template <class T> static inline T __shfl_xor_sync(unsigned int, T v, int, int = 32) { return v; }
static inline unsigned int __ballot_sync(unsigned int, int p) { return p ? 1u : 0u; }
static inline int __ffs(unsigned int x) { return __builtin_ffs((int)x); }
static inline void __syncthreads() {}
static inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
static inline float cospif(float x) { return std::cos(3.14159265f * x); }
static inline float sinpif(float x) { return std::sin(3.14159265f * x); }
"""


def grid_wrapper(host_name: str, kernel: str, params: str, args: str) -> str:
    """C++ of `extern "C" host_name(params, unsigned int threads)`: `kernel(args)` for each of the n_chunks blocks
    (a parameter of that name) and each of `threads` threads."""
    return f"""
extern "C" void {host_name}({params}, unsigned int threads) {{
    blockDim.x = threads;
    gridDim.x = (unsigned int)n_chunks;
    for (int b = 0; b < n_chunks; ++b) {{
        blockIdx.x = (unsigned int)b;
        for (unsigned int t = 0; t < threads; ++t) {{
            threadIdx.x = t;
            {kernel}({args});
        }}
    }}
}}
"""


def build(folder: Path, source: Path, wrappers: str) -> ctypes.CDLL:
    """Compile PRELUDE, `source` and the `wrappers` into a shared library in `folder` and load it."""
    (folder / "harness.cpp").write_text(f'{PRELUDE}\n#include "{source.name}"\n{wrappers}')
    out = folder / "harness.so"
    cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off",
           "-Wno-unknown-pragmas", f"-I{source.parent}", str(folder / "harness.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(out))


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of 1-D `t` one element into a longer buffer: its pointer off the kernels' 4-element vector alignment."""
    holder = torch.zeros(t.numel() + 1, dtype=t.dtype)
    holder[1:].copy_(t)
    return holder[1:]
