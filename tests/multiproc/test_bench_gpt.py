"""CPU smoke test of launch/bench.py's gpt suite (gloo, torchrun with 2 ranks: pp=2): a tiny fp32 GPT on the
default corpus, peerline eager against every torch.distributed.pipelining candidate, and the recompute table.
The records must validate with finite ratios, and every anchor candidate (each torch schedule: 1F1B, GPipe,
Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; bench/suites/torch_schedules.py) must compute
peerline's losses from the same weights and tokens: the two only share the model builder and the text
feed, so equal losses check the anchor's wiring (split, data, loss scaling). Recomputation must not change them."""

import json
import math

import pytest

from peerline.bench.suites.torch_schedules import TORCH_SCHEDULES
from tests.multiproc.test_bench_pipeline import run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def gpt_records(out) -> list[dict]:
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["suite"] == "gpt"]
    for r in recs:
        assert r["card"] == "cpu" and r["sizes"]["pp"] == 2 and r["sizes"]["vocab"] > 256, r
        assert r["ratio"] is not None and math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["peerline"] > 0 and r["anchor"] > 0, r
    return recs


def close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) == 2 and all(math.isfinite(x) and abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def test_gpt_suite_two_ranks_with_recompute_table(tmp_path):
    out = tmp_path / "gpt"
    proc = run_bench(2, ["--gpt-recompute"], out, suites=("gpt",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_case = {r["case"]: r for r in gpt_records(out)}
    eager = by_case["quick eager"]
    assert eager["metric"] == "tokens/s" and eager["anchor_name"].startswith("torch.distributed.pipelining")
    ex = eager["extra"]
    assert ex["tflops"] > 0 and ex["mfu"] is None  # no card peak on the CPU
    assert ex["anchor_schedule"] in TORCH_SCHEDULES and ex["anchor_recipe"] == "fp32"
    assert set(ex["anchor_candidates"]) == {f"{s} fp32" for s in TORCH_SCHEDULES}  # 2 + 2 layers, M=4: all apply
    assert math.log(256) < ex["losses"][0] < 1.5 * math.log(eager["sizes"]["vocab"]), ex["losses"]
    for name, cand in ex["anchor_candidates"].items():
        assert close(cand["losses"], ex["losses"], 1e-5), (name, cand["losses"], ex["losses"])
    assert close(ex["anchor_losses"], ex["losses"], 1e-5)
    half = ex["stage_layers"] // 2
    assert half >= 1
    for setting in (str(half), "full"):
        rec = by_case[f"quick recompute {setting} time"]
        assert rec["metric"] == "ms/iter" and rec["anchor_name"] == "peerline eager --recompute off"
        assert close(rec["extra"]["losses"], rec["extra"]["off_losses"], 1e-6), rec["extra"]
    assert not any(c.endswith("peak memory") for c in by_case)  # no device memory on the CPU
    md = (out / "results.md").read_text()
    assert "| gpt | quick eager | tokens/s |" in md and "torch.distributed.pipelining candidates" in md
