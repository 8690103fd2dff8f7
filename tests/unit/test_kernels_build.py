"""Every kernel spec builds with nvcc for sm_90 (no GPU needed): PTX with 16-byte cp.async in the loader, and no
spills or stack frame in pl_main. Skipped where nvcc is missing."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from peerline.bench.kernel_tools import inspect_sass
from peerline.kernels import compile as kc

pytestmark = pytest.mark.timeout(180)

NVCC = inspect_sass.find_tool("nvcc")
# One of each op, mixed dtypes, one tuning variant (nvcc takes seconds per spec; the GPU run builds them all).
SPECS = [kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32", bias="bfloat16"),
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32", warps=8, stages=3),
         kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="bfloat16", out="float32"),
         # the direct-store engine (compute warps store to global) with 32-byte chunks and 4 stages
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32", bias="float32", direct=1, vec=2, stages=4)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kernels") / "elementwise_full.cu"
    path.write_text(kc.source_text())
    return str(path)


def _ptx(spec: kc.KernelSpec, source: str, out: str) -> str:
    subprocess.run([NVCC, "-ptx", "-arch=sm_90", "-o", out, source, *kc.nvrtc_options(spec)], check=True,
                   capture_output=True, text=True, timeout=150)
    with open(out) as f:
        return f.read()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_spec_builds_with_cp_async(source: str, tmp_path) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:  # nvcc mostly waits: run the specs side by side
        texts = list(pool.map(lambda i: _ptx(SPECS[i], source, str(tmp_path / f"k{i}.ptx")), range(len(SPECS))))
    for spec, text in zip(SPECS, texts):
        main = text[text.index(".entry pl_main"):]
        assert "cp.async.cg.shared.global" in main, spec  # 16-byte global->shared copies (LDGSTS.128 in SASS)
        assert "ld.shared.v4" in main and "st.global.v4" in main, spec  # 16-byte compute reads, storer writes


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_no_spills(source: str, tmp_path) -> None:
    spec = kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32")  # the most registers (per-slot sums)
    r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), source,
                        *kc.nvrtc_options(spec)], check=True, capture_output=True, text=True, timeout=120)
    props = re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores",
                       r.stderr)
    assert props and all(stack == "0" and spills == "0" for _, stack, spills in props), r.stderr
