"""CPU-checkable parts of the copy-engine transport: flag layout, transport choice from launcher facts."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.p2p import copy_engine as ce
from peerline.distributed.p2p import handoff_protocol as sr
from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("depth", [1, 3, 16])
def test_flag_words_are_distinct_aligned_and_inside_the_allocation(depth: int) -> None:
    offsets = [ce.flag_offset(k, f, s, depth) for k in (ACT, GRAD) for f in (sr.FULL, sr.FREE) for s in range(depth)]
    assert len(set(offsets)) == len(offsets)
    assert all(o % ce.FLAG_STRIDE == 0 for o in offsets)
    assert max(offsets) + 4 <= len(ce.KINDS) * 2 * depth * ce.FLAG_STRIDE


@pytest.mark.parametrize(("env", "single"), [
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, True),
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, False),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_SIZE": "2"}, False),
    ({"SLURM_NNODES": "1"}, True),
    ({"SLURM_NNODES": "2"}, False),
    ({}, True),
    ({"WORLD_SIZE": "2"}, False),
])
def test_single_node_from_launcher_facts(monkeypatch: pytest.MonkeyPatch, env: dict, single: bool) -> None:
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE",
                 "MPI_LOCALNRANKS", "PMI_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ce._single_node() is single


def test_not_usable_on_cpu() -> None:
    spec = TensorSpec((2, 3), torch.float32)
    assert not ce.copy_engine_usable(Links(None, 1, None, spec), torch.device("cpu"))


def test_constructor_rejects_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        ce.CopyEngineTransport(Links(None, 1, None, None), torch.device("cpu"), 4)
