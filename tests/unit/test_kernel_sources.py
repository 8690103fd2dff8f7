"""Every standalone CUDA kernel source (the files compile.load_kernel builds with NVRTC on a GPU) parses as C++
under stand-ins for the CUDA names it uses, with its local headers pasted in as load_kernel pastes them: a typo, an
undeclared name or a header that no longer provides what a kernel uses fails here, not first on a GPU. The
elementwise kernels need <cuda/pipeline> and are checked on a GPU only."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from peerline.kernels.compile import KERNEL_DIR, paste_includes
from tests.unit.kernel_host import SYNTAX_PRELUDE

GPU_ONLY = {"elementwise.cu"}  # <cuda/pipeline>
SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu") if p.name not in GPU_ONLY)


def test_the_list_holds_the_new_kernels() -> None:
    assert {"cross_entropy.cu", "embedding.cu", "graph_memset.cu", "layer_norm.cu"} <= set(SOURCES)


def _parse(text: str, folder: Path) -> subprocess.CompletedProcess:
    """g++'s syntax check of a pasted kernel source under SYNTAX_PRELUDE."""
    (folder / "k.cpp").write_text(SYNTAX_PRELUDE + text)
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(folder / "k.cpp")],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", SOURCES)
def test_source_parses(name: str, tmp_path: Path) -> None:
    proc = _parse(paste_includes((KERNEL_DIR / name).read_text(), KERNEL_DIR), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_broken_source_fails(tmp_path: Path) -> None:
    text = paste_includes((KERNEL_DIR / "cross_entropy.cu").read_text(), KERNEL_DIR)
    assert "pl_load8(row + c, v);" in text
    proc = _parse(text.replace("pl_load8(row + c, v);", "pl_lod8(row + c, v);", 1), tmp_path)
    assert proc.returncode != 0 and "pl_lod8" in proc.stderr
