"""launch/bench.py --isolate on the CPU (gloo, 2 ranks per job): every measurement of the pipeline suite is a job of
its own, so a variant that raises on rank 1 and one that hangs on rank 0 are each noted as failed with their rank's
line, the next variant still runs and is recorded against the anchor measured by an earlier job, and nothing of any
job is left running afterwards."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import timeouts

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BENCH = str(REPO / "launch" / "bench.py")


def running_with(text: str) -> list[str]:
    """Command lines of the processes that mention `text` (a test's own folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def test_failed_and_hung_variants_are_noted_and_the_bench_goes_on(tmp_path):
    out = tmp_path / "out"
    scale = timeouts.scale()
    args = ["pipeline", "--quick", "--isolate", "--ranks", "2", "--out", str(out),
            "--schedules", "gpipe,1f1b,zb-h1", "--variants", "torch,eager", "--pipeline-anchor-schedules", "gpipe",
            "--deadline-s", f"{10 * scale:.0f}", "--isolate-timeout-s", f"{150 * scale:.0f}",
            "--inject-fault", "pipeline quick gpipe eager=raise:rank=1:iter=3",
            "--inject-fault", "pipeline quick 1f1b eager=hang:rank=0:iter=3", "--no-pipeline-bubble-free"]
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=350 * scale)
    said = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, said  # a measurement failed
    outcomes = {o["id"]: o for o in map(json.loads, (out / "measurements.jsonl").read_text().splitlines())}
    assert list(outcomes) == ["pipeline quick torch", "pipeline quick gpipe eager", "pipeline quick 1f1b eager",
                              "pipeline quick zb-h1 eager"], said
    raised, hung = outcomes["pipeline quick gpipe eager"], outcomes["pipeline quick 1f1b eager"]
    assert raised["status"] == "failed" and "rank 1" in raised["error"] and "FaultRaised" in raised["error"], raised
    assert hung["status"] == "failed" and hung["error"].startswith("rank 0"), hung
    assert outcomes["pipeline quick torch"]["status"] == outcomes["pipeline quick zb-h1 eager"]["status"] == "ok"
    # the variant after the failures is recorded against the anchor that the first job measured
    recs = {r["case"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    after = recs["quick zb-h1 eager"]
    assert after["anchor_name"] == "torch.distributed.pipelining gpipe fp32" and math.isfinite(after["ratio"]), after
    assert recs["quick best"]["extra"]["peerline_best"] == "zb-h1 eager"
    assert "quick gpipe eager" not in recs and "quick 1f1b eager" not in recs
    md = (out / "results.md").read_text()
    assert f"FAILED pipeline quick gpipe eager: {raised['error']}" in md and "FAILED pipeline quick 1f1b eager" in md
    for line in ("pipeline 2/4: quick gpipe eager: FAILED", "pipeline 3/4: quick 1f1b eager: FAILED",
                 "pipeline 4/4: quick zb-h1 eager: ok"):
        assert line in proc.stdout, said
    assert running_with(str(out)) == []


def test_a_failed_anchor_is_noted_and_the_variants_still_run(tmp_path):
    """The anchor's job fails on every rank (an unknown precision recipe raises inside the measurement): it is noted
    with the rank's line, the variant after it still runs (its ideal-time record), the missing anchor is said, and
    the bubble-free time runs as a job of its own against the variant's replayed result."""
    out = tmp_path / "out"
    scale = timeouts.scale()
    args = ["pipeline", "--quick", "--isolate", "--ranks", "2", "--out", str(out), "--schedules", "1f1b",
            "--variants", "torch,eager", "--pipeline-anchor-recipes", "bogus",
            "--isolate-timeout-s", f"{150 * scale:.0f}"]
    env = dict(os.environ, PEERLINE_DEVICE="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=250 * scale)
    said = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, said
    outcomes = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert [(o["id"], o["status"]) for o in outcomes] == [("pipeline quick torch", "failed"),
                                                          ("pipeline quick 1f1b eager", "ok"),
                                                          ("pipeline quick one GPU (bubble-free)", "ok")], said
    assert outcomes[0]["error"].startswith("rank ") and "unknown precision recipe 'bogus'" in outcomes[0]["error"]
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["case"] for r in recs] == ["quick 1f1b eager vs ideal", "quick best vs bubble-free"]
    # its own job, against the variant an earlier job measured (replayed): the same losses from one process
    free = recs[1]["extra"]
    assert free["peerline_best"] == "1f1b eager"
    assert max(abs(a - b) for a, b in zip(free["one_gpu_losses"], free["losses"], strict=True)) <= 1e-5
    md = (out / "results.md").read_text()
    assert "FAILED pipeline quick torch: rank " in md and "pipeline quick: no anchor" in md, md
    assert running_with(str(out)) == []
