"""CPU smoke test of the `single` bench suite (bench/suites/single.py --quick): it runs, records the overlapped
pipeline against the bound and the serial version, and skips the allocator part without CUDA."""

from __future__ import annotations

import json

import pytest

from peerline.bench.suites import single

pytestmark = pytest.mark.timeout(120)


def test_single_suite_quick_on_cpu(tmp_path, capsys):
    assert single.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
    cases = [r["case"] for r in rows]
    assert any(c.startswith("overlap vs bound") for c in cases)
    assert any(c.startswith("overlap vs serial") for c in cases)
    for r in rows:
        assert r["peerline"] > 0 and r["anchor"] > 0 and r["card"] == "cpu"
        assert {"serial_ms", "overlap_ms", "compute_ms", "fraction_of_bound", "vs_serial"} <= set(r["extra"])
    md = (tmp_path / "single.md").read_text()
    assert "allocator comparison needs CUDA; skipped on the CPU" in md


def test_calibration_below_the_stage_count_is_clamped_and_recorded(tmp_path, monkeypatch):
    # The first GPU run: compute of the 2-layer probe exceeded the H2D time, the calibration asked for 1 layer,
    # and 2 stages cannot hold 1 layer. Here the probe's numbers are made up to the same effect.
    import torch

    from peerline.bench.benchkit import BenchContext

    built = []
    real_runtime, real_measure = single._runtime, single._measure_overlap

    def runtime(sizes, layers, device):
        built.append(layers)
        return real_runtime(sizes, layers, device)

    def measure(rt, device, n):
        m = real_measure(rt, device, n)
        if len(built) == 1:  # the calibration probe
            m.update(compute_ms=11.5, h2d_ms=9.7)
        return m

    monkeypatch.setattr(single, "_runtime", runtime)
    monkeypatch.setattr(single, "_measure_overlap", measure)
    monkeypatch.setattr(single, "_sizes", lambda args, quick, on_gpu: dict(
        hidden=32, seq=16, micro_batch_size=2, microbatches=4, layers=0, stages=2))
    ctx = BenchContext(out_dir=tmp_path, device=torch.device("cpu"), quick=True)
    extra = single.run_overlap(None, ctx)
    assert built == [2, 2]  # the probe, then the clamped run (1 layer asked for)
    assert extra["layers"] == 2 and extra["layers_requested"] == 1 and extra["layers_clamped_to_stages"] == 1.0
    assert any("cannot be split into 2 stages; using 2 layers" in n for n in ctx.notes)
    assert all(r.sizes["layers"] == 2 for r in ctx.records)
