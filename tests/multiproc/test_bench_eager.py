"""CPU smoke test of launch/bench.py's eager suite at pp=2 (gloo, --quick, no one-GPU part): every peerline variant
that runs on the CPU recorded against both torch variants, with the losses of the same model and data and each
side's host lead (how far the host ran ahead of the device: 0 on the CPU); the recipe-matched pair timed together."""

import pytest

from tests.multiproc.test_bench_pipeline import records, run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_eager_suite_quick_on_two_ranks(tmp_path):
    out = tmp_path / "bench"
    proc = run_bench(2, ["--no-eager-single"], out, suites=("eager",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = {r["case"]: r for r in records(out, "eager")}
    for variant in ("peerline", "peerline-autocast", "peerline-torch-kernels", "peerline-nccl"):
        for anchor in ("torch", "torch-bf16"):
            rec = recs[f"quick pp=2 1f1b {variant} vs {anchor}"]
            assert rec["sizes"]["pp"] == 2
            assert rec["extra"]["host_lead_ms"] is not None and rec["extra"]["anchor_host_lead_ms"] is not None
            assert rec["extra"]["losses"] == pytest.approx(rec["extra"]["anchor_losses"], rel=1e-5), rec["case"]
    out = proc.stdout + proc.stderr
    assert "(host lead " in out
    # the recipe-matched pair that runs on the CPU is timed together, its blocks alternating
    assert "eager quick pp=2 torch: " in out and "interleaved with peerline-autocast)" in out
    assert "interleaved with torch)" in out
