"""Every engine path compiles under NVRTC itself (device-only JIT mode, stricter than nvcc), without a diagnostic.
Skipped where libnvrtc or CCCL's headers are missing (set PEERLINE_NVRTC_LIB / PEERLINE_CCCL_INCLUDE)."""

from __future__ import annotations

import pytest

from peerline.kernels import nvrtc_check

pytestmark = pytest.mark.timeout(180)

LIB = nvrtc_check.find_nvrtc()
INCLUDES = nvrtc_check.find_includes()


@pytest.mark.skipif(LIB is None or not INCLUDES, reason="libnvrtc or CCCL headers not found")
@pytest.mark.parametrize("spec", nvrtc_check.SPECS, ids=lambda s: s.label())
def test_nvrtc_compiles_cleanly(spec) -> None:
    lib = nvrtc_check.load(LIB)
    rc, log = nvrtc_check.compile_spec(lib, spec, INCLUDES)
    assert rc == 0 and not log, log
