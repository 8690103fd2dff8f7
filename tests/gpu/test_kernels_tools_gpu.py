"""The elementwise kernels through external tools, one GPU: the SASS of every shipped spec has the loader's
asynchronous copies (LDGSTS for the cp.async loader, UBLKCP for the bulk one, UBLKCP.G.S exactly with the bulk
storer; nvcc + cuobjdump), and compute-sanitizer's memcheck finds no error in small launches of every loader and
store path (tests/gpu/workers/kernels_sanitize.py, each result also compared with torch). Skipped where the tools
are missing. Racecheck is a probe, not a check: tools/gpu_probes/README.md."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.gpu.jobs import WORKERS, gpu_env, outcome, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SANITIZE = str(WORKERS / "kernels_sanitize.py")


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def test_sass_of_every_spec_has_the_loader_copies(gpu_out: Path) -> None:
    from peerline.bench.kernel_tools import inspect_sass

    if not (inspect_sass.find_tool("nvcc") and inspect_sass.find_tool("cuobjdump")):
        pytest.skip("nvcc / cuobjdump not found")
    out = gpu_out / "kernels_sass"
    cmd = [sys.executable, "-m", "peerline.bench.kernel_tools.inspect_sass", "--arch", _arch(), "--out", str(out)]
    rc, tail = run(cmd, gpu_out / "kernels_sass.log", 180, gpu_env())
    assert (out / "sass_report.json").exists(), outcome("inspect_sass", rc, tail, 180)
    reports = json.loads((out / "sass_report.json").read_text())
    missing = [r["spec"] for r in reports
               if not inspect_sass.loader_copies_present(r["functions"].get("pl_main", {}), r["loader"], r["storer"])]
    assert reports and not missing, f"specs without their loader's copies: {missing}\n{tail}"
    assert rc == 0, outcome("inspect_sass", rc, tail, 180)


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    return found or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))), None)


def test_memcheck_finds_no_error(gpu_out: Path) -> None:
    san = _sanitizer()
    if san is None:
        pytest.skip("compute-sanitizer not found")
    env = gpu_env(PEERLINE_KERNEL_LINEINFO="1")  # hazards reported with source lines; the same cubins warm and run
    rc, tail = run([sys.executable, SANITIZE, "--warm"], gpu_out / "kernels_sanitize_warm.log", 120, env)
    assert rc == 0, outcome("compile warm-up (no sanitizer)", rc, tail, 120)
    # Only our kernels (extern "C" pl_*) are instrumented; without torch's caching allocator a write past an
    # output's end lands outside any allocation instead of inside a cached segment.
    cmd = [san, "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "200", "--kernel-name", "kns=pl_",
           sys.executable, SANITIZE]
    log = gpu_out / "kernels_sanitize_memcheck.txt"
    rc, tail = run(cmd, log, 90, {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    assert rc == 0 and "ERROR SUMMARY: 0 errors" in log.read_text(), outcome("memcheck", rc, tail, 90)
