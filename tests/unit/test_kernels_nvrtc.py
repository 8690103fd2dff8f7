"""Every engine path compiles under NVRTC itself (device-only JIT mode, stricter than nvcc), without a diagnostic.
Skipped where libnvrtc or CCCL's headers are missing (set PEERLINE_NVRTC_LIB / PEERLINE_CCCL_INCLUDE)."""

from __future__ import annotations

import pytest

from peerline.bench.kernel_tools import nvrtc_check
from peerline.kernels import compile as kc

pytestmark = pytest.mark.timeout(180)

LIB = nvrtc_check.find_nvrtc()
INCLUDES = nvrtc_check.find_includes()


# nvrtc_check's engine paths plus the ones added since: phi_cdf_lite (GELU_LITE, plan .p1) on the bf16 forward's
# default shape (bulk loader, direct stores, 16 warps) and the residual default (bulk loader, .cs stores).
SPECS = (*nvrtc_check.SPECS,
         kc.KernelSpec(kc.OP_BIAS_GELU_FWD, "bfloat16", bias="float32", warps=16, stages=3, tile=1024, direct=1,
                       vec=1, loader=1, gelu=kc.GELU_LITE),
         kc.KernelSpec(kc.OP_BIAS_GELU_BWD, "bfloat16", bias="float32", warps=8, stages=4, tile=0, direct=0, vec=1,
                       loader=0, gelu=kc.GELU_LITE),
         kc.KernelSpec(kc.OP_RESIDUAL_ADD, "bfloat16", y="bfloat16", out="bfloat16", warps=4, stages=4, tile=256,
                       direct=1, vec=1, loader=1, hint=1))


@pytest.mark.skipif(LIB is None or not INCLUDES, reason="libnvrtc or CCCL headers not found")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_nvrtc_compiles_cleanly(spec) -> None:
    lib = nvrtc_check.load(LIB)
    rc, log = nvrtc_check.compile_spec(lib, spec, INCLUDES)
    assert rc == 0 and not log, log
