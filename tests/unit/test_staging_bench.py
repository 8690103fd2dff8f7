"""CPU smoke test of the `single` bench suite (launch/suites/single.py --quick): it runs, records the overlapped
pipeline against the bound and the serial version, and skips the allocator part without CUDA."""

from __future__ import annotations

import json

import pytest

from peerline.launch.suites import single

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
