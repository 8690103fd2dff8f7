"""The optimizer kernels' launches on the CPU: each launch class packs exactly the parameters its `extern "C"`
kernel declares (read from the CUDA source), in order and typed alike (launch.ArgPack's letters), so a packing that
drifts from the kernel fails here and not first on a GPU. The launch itself is replaced by a recorder."""

from __future__ import annotations

import pytest
import torch

from peerline.kernels import compact_adamw, fused_adamw
from peerline.kernels.multi_tensor import CHUNK
from tests.unit.kernel_host import declared_kinds, record_launches


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple]]:
    return record_launches(monkeypatch)


def _bf16(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.bfloat16)


def test_each_launch_packs_its_kernels_parameters(recorded) -> None:
    n = CHUNK + 3
    scalar, flag = torch.zeros(()), torch.zeros(())
    hyper = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    compact_adamw.CompactAdamWLaunch([_bf16(n)], [torch.zeros(n, dtype=torch.int16)], [_bf16(n)], [_bf16(n)],
                                     [_bf16(n)])(scalar, scalar, flag, **hyper)
    fused_adamw.MasterAdamWLaunch([_bf16(n)], [_bf16(n)], [torch.zeros(n)], [torch.zeros(n)],
                                  [torch.zeros(n)])(scalar, scalar, None, **hyper)
    fused_adamw.Bf16AdamWLaunch([_bf16(n)], [_bf16(n)], [_bf16(n)], [_bf16(n)], [torch.zeros(())])(scalar, flag,
                                                                                                    **hyper)
    sources = {"pl_compact_adamw": compact_adamw.KERNEL_SOURCE, "pl_master_adamw": fused_adamw.KERNEL_SOURCE,
               "pl_bf16_adamw": fused_adamw.KERNEL_SOURCE}
    assert [name for name, _, _ in recorded] == list(sources)
    for name, kinds, values in recorded:
        assert kinds == declared_kinds(sources[name].read_text(), name), name
        assert len(values) == len(kinds), name
        assert values[1] == 1 and values[3] == 2 and values[4] == CHUNK, name  # one tensor, two chunks
        assert values[-4:] == (0.9, 0.999, 1e-8, 0.1), name
