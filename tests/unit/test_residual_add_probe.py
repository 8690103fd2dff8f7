"""tools/gpu_probes/residual_add_probe.py on the CPU: `--device cpu --quick` runs torch's add alone and prints its
tables, and with the candidate launch replaced by torch's add (one design made wrong) the sweep's plumbing checks,
excludes, picks and summarizes as on a GPU."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, cpu_env

PROBE = REPO / "tools" / "gpu_probes" / "residual_add_probe.py"


@pytest.fixture
def probe():
    sys.path.insert(0, str(PROBE.parent))
    try:
        import residual_add_probe as module
    finally:
        sys.path.pop(0)
    return module


def test_cpu_quick_run_exits_0_and_prints_its_tables() -> None:
    env = cpu_env(PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(PROBE), "--device", "cpu", "--quick"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "candidates: skipped on the CPU" in out
    assert "best design per size class and dtype" in out
    assert "SINGLE DESIGN: none" in out
    for dtype in ("fp32+fp32", "bf16+bf16", "fp32+bf16"):
        assert f"pass 2 {dtype}" in out and dtype in out.split("best design per size class")[1]


def test_the_sweep_checks_picks_and_summarizes_with_a_stand_in_kernel(probe, monkeypatch, capsys, tmp_path) -> None:
    bad = probe.Design(4, 256, "persist", "plain")

    def stand_in(design, comp, x, y, out):
        if design == bad:
            return lambda: out.zero_()
        return lambda: torch.add(x, y, out=out)

    def fake_setup(p, designs):
        p.comp = object()

    monkeypatch.setattr(probe, "candidate_call", stand_in)
    monkeypatch.setattr(probe, "setup", fake_setup)
    json_path = tmp_path / "rows.json"
    assert probe.main(["--device", "cpu", "--quick", "--keep", "2", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert f"WRONG {bad.label()}" in out
    assert "SINGLE DESIGN: u" in out
    import json

    rows = json.loads(json_path.read_text())["rows"]
    timed = {r["name"] for r in rows if r["design"] is not None}
    assert bad.label() not in timed
    assert {r["pass"] for r in rows} == {1, 2}
    assert all(r["gbps"] > 0 for r in rows)


def test_design_names_one_kernel_per_dtype_pair(probe) -> None:
    d = probe.Design(8, 512, "persist", "nc+cs", "w16")
    assert d.template(torch.float32, torch.bfloat16) == "ra<float, bf16, float, 4, 8, 1, 1, 1>"
    assert d.template(torch.bfloat16, torch.bfloat16) == "ra<bf16, bf16, bf16, 8, 8, 1, 1, 1>"
    assert probe.Design(1, 128, "chunk", "cs+cs").template(torch.float32, torch.bfloat16) == \
        "ra<float, bf16, float, 8, 1, 2, 1, 0>"
    assert len(probe.all_designs("fp32+fp32", False)) == 96
    assert len(probe.all_designs("fp32+bf16", False)) == 192
