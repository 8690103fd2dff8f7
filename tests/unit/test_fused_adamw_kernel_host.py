"""kernels/fused_adamw.cu without a GPU: its source compiled as host C++ (g++, the CUDA keywords and intrinsics
defined away, no contractions of its own; every block and thread run one after another over kernels/fused_adamw.py's
tables of CPU tensors), both kernels (pl_master_adamw, pl_bf16_adamw), against a numpy replica of torch's fused
AdamW arithmetic (fp32 throughout, its fused multiply-adds), bit for bit. So CI checks the kernels' indexing
(chunks, 4-element vectors, tails, the misaligned scalar path), their types and order of operations, the bf16
rounding, the NaN rule and found_inf. The GPUs' own runs, against torch's fused AdamW, are
tests/gpu/test_master_adamw_gpu.py and tests/gpu/test_fused_bf16_adamw_gpu.py. Skipped without g++."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

from peerline.kernels import fused_adamw as fa
from peerline.kernels.multi_tensor import CHUNK, THREADS
from tests.unit import kernel_host

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the kernel as host code")]

TABLES = "const long long* table, int tensors, const long long* chunks, int n_chunks, long long chunk"
MASTER_PARAMS = f"{TABLES}, const float* lr, const float* step, const float* found_inf, double b1, double b2, " \
                "double eps, double wd"
BF16_PARAMS = f"{TABLES}, const float* lr, const float* found_inf, double b1, double b2, double eps, double wd"
WRAPPERS = (
    kernel_host.grid_wrapper("host_master_adamw", "pl_master_adamw", MASTER_PARAMS,
                             "table, tensors, chunks, n_chunks, chunk, lr, step, found_inf, b1, b2, eps, wd")
    + kernel_host.grid_wrapper("host_bf16_adamw", "pl_bf16_adamw", BF16_PARAMS,
                               "table, tensors, chunks, n_chunks, chunk, lr, found_inf, b1, b2, eps, wd"))

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
SIZES = [1, 3, 4, 7, 1000, CHUNK - 1, CHUNK, CHUNK + 5, 2 * CHUNK + 3]


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    found = kernel_host.build(tmp_path_factory.mktemp("kernel"), fa.KERNEL_SOURCE, WRAPPERS)
    found.host_master_adamw.argtypes = kernel_host.wrapper_argtypes(MASTER_PARAMS)
    found.host_bf16_adamw.argtypes = kernel_host.wrapper_argtypes(BF16_PARAMS)
    return found


def _tensors(sizes: list[int], misaligned: bool, seed: int) -> list[list[torch.Tensor]]:
    """params, grads, masters, exp_avgs, exp_avg_sqs (the params the masters' rounding): views one element in
    when misaligned."""
    gen = torch.Generator().manual_seed(seed)
    lists: list[list[torch.Tensor]] = [[], [], [], [], []]
    for n in sizes:
        master = torch.randn(n, generator=gen) * 3
        values = [master.to(torch.bfloat16), (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16), master,
                  torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-3]
        for out, value in zip(lists, values, strict=True):
            out.append(kernel_host.misaligned(value) if misaligned else value)
    return lists


def _run(lib: ctypes.CDLL, lists, lr: float, step: float, wd: float, found_inf: torch.Tensor | None = None) -> None:
    table, chunks = fa.master_tables(*lists)
    lr_t, step_t = torch.tensor(lr, dtype=torch.float32), torch.tensor(step, dtype=torch.float32)
    inf_ptr = None if found_inf is None else found_inf.data_ptr()
    lib.host_master_adamw(table.data_ptr(), table.shape[1], chunks.data_ptr(), chunks.shape[1], CHUNK,
                          lr_t.data_ptr(), step_t.data_ptr(), inf_ptr, BETA1, BETA2, EPS, wd, THREADS)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, nearest even; NaN -> 0x7fc0 (c10::BFloat16's rounding)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _fma(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add: the product of two fp32 values is exact in fp64; the sum rounds once more there
    (a second rounding that can differ from one fp32 rounding only in rare ties, none of them in this data)."""
    return (np.float64(a) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _replica(master, grad, m, v, *, lr: float, step: float, wd: float):
    """torch's adam_math (fused_adam_utils.cuh, ADAMW, fp32 opmath) without contractions of its own: (master, m,
    v, parameter bits) after one step; `step` the count of this step."""
    f32 = np.float32
    lr32, b1, b2, wd32, eps32, t = f32(lr), f32(BETA1), f32(BETA2), f32(wd), f32(EPS), f32(step)
    bc1 = f32(1) - np.power(b1, t)
    bc2_sqrt = np.sqrt(f32(1) - np.power(b2, t))
    g = grad.astype(f32)
    w = master.astype(f32)
    if wd != 0:
        w = w - (lr32 * wd32) * w
    m32 = _fma(b1, m, _fma(-b1, g, g))
    v32 = _fma(b2, v, _fma(-b2, g * g, g * g))
    step_size = lr32 / bc1
    denom = np.sqrt(v32) / bc2_sqrt + eps32
    w = w - (step_size * m32) / denom
    return w, m32, v32, _bf16_bits(w)


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_kernel_source_is_torchs_fused_arithmetic_bit_for_bit(lib, misaligned: bool, wd: float) -> None:
    lists = _tensors(SIZES, misaligned, seed=1)
    table, _ = fa.master_tables(*lists)
    assert table[6].tolist() == [0 if misaligned else 1] * len(SIZES)  # the path under test
    lr, step = 1e-2, 5.0
    want = [_replica(lists[2][i].numpy(), lists[1][i].float().numpy(), lists[3][i].numpy(), lists[4][i].numpy(),
                     lr=lr, step=step, wd=wd) for i in range(len(SIZES))]
    _run(lib, lists, lr, step, wd)
    for i, n in enumerate(SIZES):
        w, m, v, bits = want[i]
        assert np.array_equal(lists[2][i].numpy().view(np.uint32), w.view(np.uint32)), n
        assert np.array_equal(lists[3][i].numpy().view(np.uint32), m.view(np.uint32)), n
        assert np.array_equal(lists[4][i].numpy().view(np.uint32), v.view(np.uint32)), n
        assert np.array_equal(lists[0][i].view(torch.int16).numpy().view(np.uint16), bits), n


def test_nan_rounds_to_c10s_nan_and_found_inf_skips(lib) -> None:
    lists = _tensors([9], misaligned=False, seed=2)
    lists[1][0][4] = float("nan")
    _run(lib, lists, 1e-2, 1.0, 0.01)
    assert int(lists[0][0].view(torch.int16)[4]) == 0x7FC0 and torch.isnan(lists[2][0][4])
    assert torch.isfinite(lists[2][0][torch.arange(9) != 4]).all()
    before = [t[0].clone() for t in lists]
    _run(lib, lists, 1e-2, 2.0, 0.01, found_inf=torch.ones(()))
    assert all(torch.equal(a, t[0]) or (torch.isnan(a) == torch.isnan(t[0])).all() and
               torch.equal(a.nan_to_num(), t[0].nan_to_num()) for a, t in zip(before, lists, strict=True))


def test_tables_refuse_what_the_kernel_cannot_read() -> None:
    lists = _tensors([8], misaligned=False, seed=3)
    with pytest.raises(ValueError, match="master AdamW: a master is torch.bfloat16"):
        fa.master_tables(lists[0], lists[1], [lists[2][0].to(torch.bfloat16)], lists[3], lists[4])
    with pytest.raises(ValueError, match="non-empty lists of one length"):
        fa.master_tables(lists[0], lists[1], lists[2], lists[3], [])


def _bf16_tensors(sizes: list[int], misaligned: bool, seed: int) -> list[list[torch.Tensor]]:
    """params, grads, exp_avgs, exp_avg_sqs, all bf16: views one element in when misaligned."""
    params, grads, _, ms, vs = _tensors(sizes, False, seed)
    lists = [params, grads, [m.to(torch.bfloat16) for m in ms], [v.to(torch.bfloat16) for v in vs]]
    return [[kernel_host.misaligned(t) for t in ts] for ts in lists] if misaligned else lists


@pytest.mark.parametrize("misaligned", [False, True])
def test_bf16_kernel_source_is_torchs_fused_arithmetic_bit_for_bit(lib, misaligned: bool) -> None:
    lists = _bf16_tensors(SIZES, misaligned, seed=4)
    steps = [torch.tensor(float(3 + i % 3)) for i in range(len(SIZES))]  # each parameter's own count
    table, chunks = fa.bf16_tables(lists[0], lists[1], lists[2], lists[3], steps)
    assert table[6].tolist() == [0 if misaligned else 1] * len(SIZES)
    lr, wd = 1e-2, 0.1
    want = [_replica(lists[0][i].float().numpy(), lists[1][i].float().numpy(), lists[2][i].float().numpy(),
                     lists[3][i].float().numpy(), lr=lr, step=float(steps[i]), wd=wd) for i in range(len(SIZES))]
    lr_t = torch.tensor(lr, dtype=torch.float32)
    lib.host_bf16_adamw(table.data_ptr(), table.shape[1], chunks.data_ptr(), chunks.shape[1], CHUNK,
                        lr_t.data_ptr(), None, BETA1, BETA2, EPS, wd, THREADS)
    for i, n in enumerate(SIZES):
        _, m, v, bits = want[i]
        assert np.array_equal(lists[0][i].view(torch.int16).numpy().view(np.uint16), bits), n
        assert np.array_equal(lists[2][i].view(torch.int16).numpy().view(np.uint16), _bf16_bits(m)), n
        assert np.array_equal(lists[3][i].view(torch.int16).numpy().view(np.uint16), _bf16_bits(v)), n


def test_bf16_tables_want_one_step_count_per_parameter() -> None:
    lists = _bf16_tensors([8, 3], misaligned=False, seed=5)
    with pytest.raises(ValueError, match="one fp32 step count"):
        fa.bf16_tables(lists[0], lists[1], lists[2], lists[3], [torch.tensor(1.0)])
