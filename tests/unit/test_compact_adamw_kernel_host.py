"""kernels/compact_adamw.cu without a GPU: its source compiled as host C++ (g++, the CUDA keywords and intrinsics
defined away, every block and thread run one after another over kernels/compact_adamw.py's tables of CPU tensors)
against the CPU path, so CI checks the kernel's indexing (chunks, 4-element vectors, tails, the misaligned scalar
path), its arithmetic, the NaN rule, found_inf and the step count. Threads of this kernel share nothing, so running
them in turn is the kernel's meaning; the GPU's own run is tests/gpu/test_compact_adamw_gpu.py. Skipped without
g++."""

from __future__ import annotations

import ctypes
import math
import shutil

import pytest
import torch

from peerline.kernels import compact_adamw as ca
from peerline.kernels.multi_tensor import CHUNK, THREADS
from tests.unit import kernel_host

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel as host code")]

PARAMS = "const long long* table, int tensors, const long long* chunks, int n_chunks, long long chunk, " \
         "const float* lr, const float* step, const float* found_inf, float b1, float b2, float eps, float wd"
WRAPPERS = kernel_host.grid_wrapper(
    "host_compact_adamw", "pl_compact_adamw", PARAMS,
    "table, tensors, chunks, n_chunks, chunk, lr, step, found_inf, b1, b2, eps, wd") + """
extern "C" void host_advance(float* step, const float* found_inf) { pl_compact_adamw_advance(step, found_inf); }
"""

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
SIZES = [1, 3, 4, 7, 1000, CHUNK - 1, CHUNK, CHUNK + 5, 2 * CHUNK + 3]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    found = kernel_host.build(tmp_path_factory.mktemp("kernel"), ca.KERNEL_SOURCE, WRAPPERS)
    found.host_compact_adamw.argtypes = kernel_host.wrapper_argtypes(PARAMS)
    found.host_advance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return found


def _tensors(sizes: list[int], misaligned: bool, seed: int) -> list[list[torch.Tensor]]:
    """params, remainders, grads, exp_avgs, exp_avg_sqs: views at an odd element offset when misaligned."""
    gen = torch.Generator().manual_seed(seed)
    lists: list[list[torch.Tensor]] = [[], [], [], [], []]
    for n in sizes:
        master = torch.randn(n, generator=gen) * 3
        values = [ca.split_master(master)[0],
                  torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int32).to(torch.int16),
                  (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16),
                  (torch.randn(n, generator=gen) * 0.01).to(torch.bfloat16),
                  (torch.rand(n, generator=gen) * 1e-3).to(torch.bfloat16)]
        for out, value in zip(lists, values, strict=True):
            out.append(kernel_host.misaligned(value) if misaligned else value)
    return lists


def _run(lib: ctypes.CDLL, lists, lr: float, step: float, wd: float, found_inf: torch.Tensor | None = None) -> None:
    table, chunks = ca.build_tables(*lists)
    lr_t, step_t = torch.tensor(lr, dtype=torch.float32), torch.tensor(step, dtype=torch.float32)
    inf_ptr = None if found_inf is None else found_inf.data_ptr()
    lib.host_compact_adamw(table.data_ptr(), table.shape[1], chunks.data_ptr(), chunks.shape[1], CHUNK,
                           lr_t.data_ptr(), step_t.data_ptr(), inf_ptr, BETA1, BETA2, EPS, wd, THREADS)


def _slack(p, r, g, m, v, *, lr: float, wd: float, step: float) -> torch.Tensor:
    """How far two fp32 evaluations of one step may differ beyond the master's ulps: 2^-21 of the decay and of the
    update computed from the first moment's terms (where they cancel, the moment's relative error grows)."""
    c = ca.adam_coefficients(lr=lr, step=step, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    g64 = g.double()
    m_terms = c["beta1"] * m.double().abs() + c["one_minus_beta1"] * g64.abs()
    v64 = c["beta2"] * v.double() + c["one_minus_beta2"] * g64 * g64
    denom = v64.sqrt() / c["bc2_sqrt"] + c["eps"]
    master = ca.combine_master(p, r).double()
    return 2.0 ** -21 * (c["lr_wd"] * master.abs() + c["step_size"] * m_terms / denom)


@pytest.mark.parametrize("misaligned", [False, True])
def test_kernel_source_matches_the_cpu_path(lib, misaligned: bool) -> None:
    lists = _tensors(SIZES, misaligned, seed=1)
    table, _ = ca.build_tables(*lists)
    assert table[6].tolist() == [0 if misaligned else 1] * len(SIZES)  # the path under test
    ref = [[t.clone() for t in ts] for ts in lists]
    lr, wd, count = 1e-2, 0.1, 4.0
    slack = [_slack(*(ts[i] for ts in lists), lr=lr, wd=wd, step=count + 1) for i in range(len(SIZES))]
    _run(lib, lists, lr, count, wd)
    ca.compact_adamw_step_(*ref, lr=lr, step=count + 1, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd)
    for i, n in enumerate(SIZES):
        got = ca.combine_master(lists[0][i], lists[1][i]).double()
        want = ca.combine_master(ref[0][i], ref[1][i]).double()
        spacing = (torch.nextafter(want.float().abs(), torch.tensor(math.inf)) - want.float().abs()).double()
        assert ((got - want).abs() <= 2 * spacing + slack[i]).all(), (n, ((got - want).abs() / spacing).max())
        assert torch.equal(lists[0][i].view(torch.int16), ca.split_master(got.float())[0].view(torch.int16))
        for k in (3, 4):
            differ = (lists[k][i].view(torch.int16) != ref[k][i].view(torch.int16)).float().mean().item()
            assert differ < 0.01, (n, k, differ)


def test_nan_update_stays_nan_and_found_inf_skips(lib) -> None:
    lists = _tensors([9], misaligned=False, seed=2)
    lists[2][0][4] = float("nan")
    _run(lib, lists, 1e-2, 0.0, 0.01)
    assert torch.isnan(lists[0][0][4].float()) and int(lists[1][0][4]) == 0
    assert torch.isfinite(lists[0][0][torch.arange(9) != 4].float()).all()
    before = [t[0].clone() for t in lists]
    _run(lib, lists, 1e-2, 1.0, 0.01, found_inf=torch.ones(()))
    assert all(torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                           t[0].view(torch.int16) if t[0].is_floating_point() else t[0])
               for a, t in zip(before, lists, strict=True))


def test_advance_counts_unless_found_inf(lib) -> None:
    step, flag = torch.zeros(()), torch.zeros(())
    lib.host_advance(step.data_ptr(), None)
    lib.host_advance(step.data_ptr(), flag.data_ptr())
    flag.fill_(1.0)
    lib.host_advance(step.data_ptr(), flag.data_ptr())
    assert float(step) == 2.0
