"""CPU tests of distributed/memory/allocator.py (the PYTORCH_CUDA_ALLOC_CONF edit, the too-late check, bad input) and
of the bench's variable-size scratch hooks, bench/load.py (sizes vary, outputs unchanged)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from peerline.bench.load import ScratchJitter
from peerline.distributed.config import ConfigError
from peerline.distributed.memory import allocator
from peerline.distributed.memory.allocator import alloc_conf_with_backend, configure_allocator

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("conf,kind,want", [
    ("", "async", "backend:cudaMallocAsync"),
    ("", "caching", ""),
    ("max_split_size_mb:128", "async", "backend:cudaMallocAsync,max_split_size_mb:128"),
    ("backend:cudaMallocAsync,max_split_size_mb:64", "caching", "max_split_size_mb:64"),
    ("expandable_segments:True, backend:native", "async", "backend:cudaMallocAsync"),
    ("backend:native", "caching", ""),
])
def test_alloc_conf_with_backend(conf, kind, want):
    assert alloc_conf_with_backend(conf, kind) == want


@pytest.mark.parametrize("kind,threshold,message", [
    ("pool", None, "unknown allocator 'pool'; choose one of caching, async"),
    ("caching", 0, "applies to --allocator async only"),
    ("async", -1, "must be 0..2\\*\\*64-1 bytes"),
])
def test_bad_allocator_settings(kind, threshold, message):
    with pytest.raises(ConfigError, match=message):
        configure_allocator(kind, threshold)


def test_configure_before_torch_import_sets_the_environment():
    code = ("import os, sys\n"
            "from peerline.distributed.memory.allocator import configure_allocator\n"
            "assert 'torch' not in sys.modules, 'peerline.distributed.memory.allocator must not import torch'\n"
            "configure_allocator('async', 1 << 20)\n"
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])\n")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:32")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "backend:cudaMallocAsync,max_split_size_mb:32"


def test_too_late_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(allocator, "_loaded_backend", lambda: "native")
    with pytest.raises(ConfigError, match="--allocator async must be chosen before torch is imported: torch is "
                                          "already imported with the native allocator .*backend:cudaMallocAsync"):
        configure_allocator("async")
    configure_allocator("caching")  # what is loaded already: fine


def test_cpu_build_accepts_and_counts_nothing():
    configure_allocator("caching")  # torch is imported here; a CPU build has no CUDA allocator
    assert allocator.allocation_count(torch.device("cpu")) == 0


def test_scratch_jitter_varies_sizes_and_leaves_outputs_alone():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))]
    x = torch.randn(2, 16, 8)
    want = [s(x).detach() for s in stages]
    jit = ScratchJitter(0.5, microbatches=4).install(stages)
    for _ in range(3):  # three iterations of 4 microbatches
        for _mb in range(4):
            for s, w in zip(stages, want):
                assert torch.equal(s(x).detach(), w)
    assert len(jit.sizes) == 2 * 3 * 4
    assert len(set(jit.sizes)) > 4, jit.sizes  # sizes vary by (iteration, microbatch)
    assert all(2 * 8 * 32 <= n <= 2 * 16 * 32 for n in jit.sizes)  # seq' in [seq/2, seq], width 4 x 8
    assert len(jit.live) == 2 * 4  # one live scratch per (stage, microbatch)
    assert jit.seq_for(16, 5, 2) == jit.seq_for(16, 5, 2)
    jit.remove()
    stages[0](x)
    assert len(jit.sizes) == 24


def test_scratch_jitter_rejects_bad_jitter():
    with pytest.raises(ValueError, match="scratch jitter must be in"):
        ScratchJitter(1.0, microbatches=2)


def test_preconfigure_from_argv_before_torch():
    code = ("import os, sys\n"
            "from peerline.distributed.memory.allocator import preconfigure_from_argv\n"
            "assert preconfigure_from_argv(['--iters', '3', '--allocator', 'async', '--pool-release-threshold', '0'])"
            " is None\n"
            "assert 'torch' not in sys.modules\n"
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])\n"
            "print(preconfigure_from_argv(['--allocator', 'pool']))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PEERLINE_ALLOCATOR")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["backend:cudaMallocAsync",
                                        "unknown allocator 'pool'; choose one of caching, async"]


def test_no_choice_keeps_the_environments_backend_and_an_explicit_conflict_is_an_error(monkeypatch):
    # The first GPU run: a process started with the async backend, then a RunConfig that named no allocator.
    monkeypatch.setattr(allocator, "_loaded_backend", lambda: "cudaMallocAsync")
    monkeypatch.setitem(allocator._chosen, "threshold", None)
    configure_allocator(None)  # no choice: whatever the environment chose
    configure_allocator(None, 0)  # a threshold without a choice: checked against the backend once CUDA runs
    assert allocator._chosen["threshold"] == 0
    configure_allocator("async", 0)  # the same choice, said explicitly: fine
    with pytest.raises(ConfigError, match="--allocator caching must be chosen before torch is imported: torch is "
                                          "already imported with the cudaMallocAsync allocator"):
        configure_allocator("caching")
    with pytest.raises(ConfigError, match="--pool-release-threshold must be 0..2"):
        configure_allocator(None, -1)


def test_preconfigure_without_a_choice_leaves_the_environment_alone():
    code = ("import os, sys\n"
            "from peerline.distributed.memory.allocator import preconfigure_from_argv\n"
            "assert preconfigure_from_argv(['--iters', '3']) is None\n"
            "assert 'torch' not in sys.modules\n"
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PEERLINE_ALLOCATOR"}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "backend:cudaMallocAsync"
