"""tools/gpu_probes/stage_kernels_probe.py on the CPU with a tiny stage: both sides build the same blocks (parameter
counts, bf16 parameters, each side's RoPE table kept in its own dtype), and one run prints each side's time by
class and its top ops, the class table and the attention line."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

PROBES = Path(__file__).resolve().parents[2] / "tools" / "gpu_probes"
HIDDEN, HEADS, BLOCKS = 32, 2, 2
TINY = ["--device", "cpu", "--blocks", str(BLOCKS), "--hidden", str(HIDDEN), "--heads", str(HEADS), "--seq", "16",
        "--microbatches", "2", "--iters", "1", "--warmup", "1", "--top", "4"]
BLOCK_PARAMS = 12 * HIDDEN * HIDDEN + 9 * HIDDEN  # qkv, proj, fc1, fc2 weights; fc1, fc2 biases; two LayerNorms

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    sys.path.insert(0, str(PROBES))  # the probe imports its neighbour top_kernels as a script does
    try:
        return importlib.import_module("stage_kernels_probe")
    finally:
        sys.path.remove(str(PROBES))


def test_both_sides_build_the_same_blocks(probe: ModuleType) -> None:
    a = probe.parse_args(TINY)
    (plain, plain_blocks), (ours, our_blocks) = (probe.BUILDERS[s](a, torch.device("cpu")) for s in probe.SIDES)
    assert probe.block_params(plain_blocks) == probe.block_params(our_blocks) == [BLOCK_PARAMS] * BLOCKS
    assert {p.dtype for m in (plain, ours) for p in m.parameters()} == {torch.bfloat16}
    assert plain.freqs_cis.dtype == torch.complex64
    assert {b.rope_cos.dtype for b in our_blocks} == {torch.float32}


def test_prints_each_side_the_class_table_and_attention(probe: ModuleType, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEERLINE_ATTENTION", raising=False)
    probe.main(TINY)
    out = capsys.readouterr().out
    for side in probe.SIDES:
        head = re.search(rf"^INFO {side}: {BLOCKS} blocks of (\d+) parameters; self CPU time ([\d.]+) ms per "
                         r"iteration \(wall [\d.]+ ms unprofiled\): .*gemm", out, re.M)
        assert head and int(head[1]) == BLOCK_PARAMS and float(head[2]) > 0, out
        rows = re.findall(rf"^INFO {side} +([\d.]+) ms +x +\d+ +(\S.*)$", out, re.M)
        assert 1 <= len(rows) <= 4 and float(rows[0][0]) > 0, out
        assert all(op.startswith("aten::") for _, op in rows), out  # the engine's own events are not the stage's work
    table = {m[0]: (float(m[1]), float(m[2]), float(m[3])) for m in
             re.findall(r"^INFO (\w+) +([\d.]+) +([\d.]+) +([+-][\d.]+)$", out, re.M)}
    assert set(table) == {"gemm", "attention", "other", "copies", "total"}, out
    for torch_ms, peerline_ms, diff in (table["gemm"], table["total"]):
        assert torch_ms > 0 and peerline_ms > 0 and diff == pytest.approx(peerline_ms - torch_ms, abs=0.011)
    assert re.search(r"^INFO attention: torch's SDPA picks \w+ for the plain model; peerline \(kernels torch, "
                     r"PEERLINE_ATTENTION=auto\): the unfused reference path", out, re.M), out


def test_host_rows_keep_the_autograd_engine_that_the_cpu_rows_leave_out(probe: ModuleType) -> None:
    w = torch.randn(8, 8, requires_grad=True)
    with probe.profile(activities=[probe.ProfilerActivity.CPU]) as prof:
        (torch.randn(4, 8) @ w).square().sum().backward()
    host, _ = probe.host_rows(prof)
    cpu, calls = probe.device_rows(prof, on_gpu=False)
    assert any(name.startswith("autograd::engine") for name in host), sorted(host)
    assert cpu and all(name.startswith("aten::") for name in cpu) and calls["aten::mm"] >= 1, sorted(cpu)
    assert set(cpu) <= set(host)


def test_sides_take_their_iterations_in_turn_the_first_swapped_each_round(probe: ModuleType,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a = probe.parse_args([*TINY, "--iters", "3", "--warmup", "2"])
    ran: list[str] = []
    models: dict[int, str] = {}
    builders = {name: (lambda args, dev, name=name, build=probe.BUILDERS[name]: _named(build(args, dev), name, models))
                for name in probe.SIDES}
    monkeypatch.setattr(probe, "BUILDERS", builders)
    monkeypatch.setattr(probe, "stage_iteration", lambda model, x, m: ran.append(models[id(model)]))
    sides = probe.run_sides(a, torch.device("cpu"))
    first, second = probe.SIDES
    warm = [first] * 2 + [second] * 2
    rounds = [first, second, second, first, first, second]  # 3 timed rounds, then the same for the profiled ones
    assert ran == warm + rounds + rounds
    assert [s.name for s in sides] == list(probe.SIDES) and all(s.wall_s > 0 for s in sides)


def _named(built: tuple, name: str, models: dict[int, str]) -> tuple:
    models[id(built[0])] = name
    return built
