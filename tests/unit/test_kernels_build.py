"""Every kernel spec builds with nvcc for sm_90 (no GPU needed): PTX with 16-byte cp.async in the loader, and no
spills or stack frame in any function. One nvcc run per spec gives both (the cubin with ptxas's report, the PTX kept
beside it). Skipped where nvcc is missing."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from peerline.bench.kernel_tools import inspect_sass
from peerline.kernels import compile as kc

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NVCC = inspect_sass.find_tool("nvcc")
# One of each op, mixed dtypes, two tuning variants (nvcc takes seconds per spec; the GPU run builds them all). The
# bf16 bias+GELU backward keeps the most registers (per-slot sums): its default tuning is the one to spill first.
SPECS = [kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "float32", bias="bfloat16"),
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32"),
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32", warps=8, stages=3),
         kc.KernelSpec(kc.OP_RESIDUAL_ADD, "float32", y="bfloat16", out="float32"),
         # the direct-store engine (compute warps store to global) with 32-byte chunks and 4 stages
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "float32", bias="float32", direct=1, vec=2, stages=4)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kernels") / "elementwise_full.cu"
    path.write_text(kc.source_text())
    return str(path)


def _build(spec: kc.KernelSpec, source: str, folder: Path) -> tuple[str, str]:
    """The spec's PTX and ptxas's report (`-Xptxas -v`) from one nvcc run that builds its cubin."""
    folder.mkdir()
    r = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-Xptxas", "-v", "--keep", "--keep-dir", str(folder),
                        "-o", str(folder / "k.cubin"), source, *kc.nvrtc_options(spec)],
                       check=True, capture_output=True, text=True, timeout=150)
    (ptx,) = folder.glob("*.ptx")
    return ptx.read_text(), r.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_spec_builds_with_cp_async_and_no_spills(source: str, tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=len(SPECS)) as pool:  # nvcc mostly waits: run the specs side by side
        built = list(pool.map(lambda i: _build(SPECS[i], source, tmp_path / f"k{i}"), range(len(SPECS))))
    for spec, (text, report) in zip(SPECS, built, strict=True):
        main = text[text.index(".entry pl_main"):]
        assert "cp.async.cg.shared.global" in main, spec  # 16-byte global->shared copies (LDGSTS.128 in SASS)
        assert "ld.shared.v4" in main and "st.global.v4" in main, spec  # 16-byte compute reads, storer writes
        props = re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores",
                           report)
        assert props and all(stack == "0" and spills == "0" for _, stack, spills in props), (spec, report)
