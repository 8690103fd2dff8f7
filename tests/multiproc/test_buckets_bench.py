"""The allreduce bench suite's CPU smoke run (--quick: tiny model, gloo, 2 ranks under torchrun) writes its
records: step times next to DDP, exposed all-reduce and hidden share per NCCL CTA cap, bucket busbw alone after
backward next to the plain all-reduce."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_allreduce_suite_quick(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "bench" / "suites" / "allreduce.py"), "--quick", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    records = [json.loads(line) for line in (tmp_path / "allreduce.jsonl").read_text().splitlines()]
    cases = {r["case"].split(": ", 1)[1]: r for r in records}
    assert {"step (eager)", "exposed all-reduce", "hidden share"} <= set(cases)
    assert cases["step (eager)"]["peerline"] > 0 and cases["step (eager)"]["anchor"] > 0
    assert 0.0 <= cases["hidden share"]["peerline"] <= 1.0
    assert cases["exposed all-reduce"]["peerline"] >= 0.0
    assert (tmp_path / "allreduce.md").exists()
    # The CTA sweep (quick: caps 0 and 4; gloo ignores them) measures every cap, one headline; the bucket layout's
    # busbw alone after backward sits next to the plain all-reduce for the headline cap.
    steps = [r for r in records if r["case"].endswith("step (eager)")]
    assert sorted((r["sizes"]["nccl_max_ctas"], r["sizes"]["allreduce_stream_priority"]) for r in steps) == [
        (0, "high"), (0, "normal"), (4, "high")]
    assert sum(r["extra"]["headline"] for r in steps) == 1
    alone = [r for r in records if "busbw, alone after backward" in r["case"]]
    assert alone and all(r["peerline"] > 0 and r["anchor"] > 0 and r["extra"]["alone_ms"] > 0 for r in alone)
    assert len(re.findall(r"^SWEEP allreduce ", proc.stdout + proc.stderr, re.M)) == 3  # + normal priority
    # Head-to-head rounds (quick: 2 rounds on each of the two shape names; no graph on the CPU): peerline eager
    # against DDP, interleaved, with per-round times and the paired ratio, and their GOAL lines.
    h2h = [r for r in records if r["case"].startswith("head-to-head ")]
    # the runtime's setting (quick: a 4-CTA cap gloo ignores) and the diagnostic NCCL-default-CTAs variant
    assert sorted(r["case"] for r in h2h) == [
        "head-to-head anchor: peerline eager step vs DDP",
        "head-to-head anchor: peerline eager, NCCL default CTAs step vs DDP",
        "head-to-head launch: peerline eager step vs DDP",
        "head-to-head launch: peerline eager, NCCL default CTAs step vs DDP"]
    for r in h2h:
        e = r["extra"]
        assert len(e["round_ms"]) == len(e["ddp_round_ms"]) == e["rounds"] == 2
        assert all(x > 0 for x in e["round_ms"] + e["ddp_round_ms"])
        assert e["paired_ratio_min"] <= e["paired_ratio_median"] <= e["paired_ratio_max"]
    assert len(re.findall(r"^GOAL (MET|MISSED) allreduce head-to-head ", proc.stdout + proc.stderr, re.M)) == 2


def test_allreduce_suite_refuses_a_single_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "suites" / "allreduce.py"), "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("allreduce bench: error:")
