"""CPU smoke test of launch/bench.py's gpt suite (gloo, 2 forked ranks: pp=2): a tiny fp32 GPT on the
default corpus, peerline eager (1F1B, and zbv and interleaved with two stages per rank) against every
torch.distributed.pipelining candidate of the anchor (the plain torch GPT of bench/suites/plain_gpt.py: each torch
schedule, 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, with its blocks eager and,
where the schedule allows, compiled: torch.compile with the aot_eager backend, which traces as inductor would without
generating code), the second torch row (peerline's GPT under torch), and the recompute table.

The records must validate with finite ratios and name their models. Every plain candidate must compute the losses
of the plain model trained in this process on the same tokens (the anchor shares only the text feed and the stage
split with peerline, so equal losses check its wiring: split, data, loss scaling), and every candidate of peerline's
GPT under torch peerline's own losses from the same weights. Recomputation must not change them."""

import json
import math

import pytest
import torch

from peerline.bench.suites.gpt import CONFIGS
from peerline.bench.suites.gpt_anchor import GPTShape, token_source
from peerline.bench.suites.plain_gpt import PlainGPT, cross_entropy_loss
from peerline.bench.suites.torch_schedules import TORCH_SCHEDULES
from tests.multiproc.test_bench_pipeline import run_bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PLAIN, PEERLINE_UNDER_TORCH = "plain torch GPT", "peerline's GPT under torch"


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


def plain_losses(shape: GPTShape, iters: int = 2) -> list[float]:
    """The plain model's first losses trained whole in this process on the suite's tokens: the mean loss over the
    microbatches, their gradients averaged, one AdamW step per iteration."""
    vocab, fill = token_source(shape)
    model = PlainGPT(vocab=vocab, hidden=shape.hidden, heads=shape.heads, layers=shape.layers, seq=shape.seq,
                     seed=shape.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr)
    losses = []
    for iteration in range(iters):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(shape.microbatches):
            ids, labels = (torch.empty(shape.micro_batch_size, shape.seq, dtype=torch.int64) for _ in range(2))
            fill(ids, labels, iteration, mb)
            loss = cross_entropy_loss(model(ids), labels)
            (loss / shape.microbatches).backward()
            total += loss.item()
        optimizer.step()
        losses.append(total / shape.microbatches)
    return losses


def test_gpt_suite_two_ranks_with_recompute_table(tmp_path):
    out = tmp_path / "gpt"
    proc = run_bench(2, ["--gpt-recompute", "--gpt-anchor-compile", "both", "--gpt-compile-backend", "aot_eager",
                         "--gpt-schedules", "1f1b,zbv,interleaved", "--gpt-kernels", "auto,torch",
                         "--gpt-zb-memory", "fast,1f1b", "--gpt-zb-orders", "list,paper"], out, suites=("gpt",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_case = {r["case"]: r for r in gpt_records(out)}
    eager = by_case["quick eager"]
    assert eager["metric"] == "tokens/s" and eager["anchor_name"].startswith(f"torch.distributed.pipelining {PLAIN} ")
    ex = eager["extra"]
    assert ex["tflops"] > 0 and ex["mfu"] is None  # no card peak on the CPU
    assert ex["model"] == "peerline's GPT" and ex["anchor_model"] == PLAIN
    assert ex["anchor_schedule"] in TORCH_SCHEDULES and ex["anchor_recipe"] == "fp32"
    assert ex["anchor_blocks"] in ("eager", "compiled")
    compiled = {s for s, spec in TORCH_SCHEDULES.items() if not spec.splits_backward}
    assert set(ex["anchor_candidates"]) == {f"{s} fp32 eager" for s in TORCH_SCHEDULES} | {
        f"{s} fp32 compiled" for s in compiled}  # 2 + 2 layers, M=4: every schedule applies
    assert math.log(256) < ex["losses"][0] < 1.5 * math.log(eager["sizes"]["vocab"]), ex["losses"]
    reference = plain_losses(CONFIGS["quick"])
    for name, cand in ex["anchor_candidates"].items():
        assert close(cand["losses"], reference, 1e-5), (name, cand["losses"], reference)
    assert close(ex["anchor_losses"], ex["losses"], 0.01)  # two models of the same shape from their own inits
    # what each side holds per rank: the same parameter count (the same architecture), fp32 here on both sides
    mine, theirs = ex["state_bytes"], ex["anchor_state_bytes"]
    assert set(mine) == set(theirs) == {"parameters", "gradients", "optimizer_state"}
    assert sum(mine["parameters"]) == sum(theirs["parameters"]) > 0, (mine, theirs)
    assert all(o >= 2 * p for o, p in zip(theirs["optimizer_state"], theirs["parameters"], strict=True)), theirs

    row = by_case["quick torch-peerline-gpt"]
    assert row["anchor_name"] == eager["anchor_name"] and row["extra"]["model"] == PEERLINE_UNDER_TORCH
    assert set(row["extra"]["candidates"]) == {f"{s} fp32 eager" for s in TORCH_SCHEDULES}
    for name, cand in row["extra"]["candidates"].items():  # peerline's weights under torch: peerline's losses
        assert close(cand["losses"], ex["losses"], 1e-5), (name, cand["losses"], ex["losses"])

    for placed in ("zbv", "interleaved"):  # two stages per rank: the suite gives them --stages 2
        rec = by_case[f"quick eager {placed}"]
        assert rec["extra"]["schedule"] == placed and close(rec["extra"]["losses"], ex["losses"], 1e-5), rec["extra"]

    for placed in ("", " zbv", " interleaved"):  # --gpt-kernels torch: the same runs with --kernels torch
        rec = by_case[f"quick eager{placed} kernels-torch"]
        assert rec["extra"]["kernels"] == "torch" and rec["anchor_name"] == eager["anchor_name"], rec["extra"]
        assert close(rec["extra"]["losses"], ex["losses"], 1e-6), rec["extra"]  # the CPU runs torch's ops either way
    assert ex["kernels"] == "auto"
    for case, rec in by_case.items():  # --gpt-paired (default): each variant against the anchor timed in turn with it
        if case.startswith("quick eager"):
            assert rec["extra"]["anchor_paired"] is True and rec["extra"]["anchor_search_ms"] > 0, (case, rec["extra"])
            assert rec["extra"]["anchor_ms_per_iter"] > 0 and rec["anchor"] > 0, (case, rec["extra"])
    capped = by_case["quick eager zbv zb-memory-1f1b zb-order-list"]["extra"]  # --gpt-zb-memory: zero-bubble only
    assert capped["zb_memory"] == "1f1b" and close(capped["losses"], ex["losses"], 1e-5), capped
    assert not any("zb-memory" in case for case in by_case if " zbv" not in case), sorted(by_case)
    listed = by_case["quick eager zbv zb-order-list"]["extra"]  # --gpt-zb-orders: zbv and zb-interleaved only
    assert listed["zb_order"] == "list" and close(listed["losses"], ex["losses"], 1e-5), listed
    assert by_case["quick eager zbv"]["extra"]["zb_order"] == "paper"  # the run's default
    assert not any("zb-order" in case for case in by_case if " zbv" not in case), sorted(by_case)

    half = ex["stage_layers"] // 2
    assert half >= 1
    for setting in (str(half), "full"):
        rec = by_case[f"quick recompute {setting} time"]
        assert rec["metric"] == "ms/iter" and rec["anchor_name"] == "peerline eager --recompute off"
        assert close(rec["extra"]["losses"], rec["extra"]["off_losses"], 1e-6), rec["extra"]
    assert not any(c.endswith("peak memory") for c in by_case)  # no device memory on the CPU
    md = (out / "results.md").read_text()
    assert "| gpt | quick eager | tokens/s |" in md and "| gpt | quick torch-peerline-gpt | tokens/s |" in md
    assert f"torch.distributed.pipelining candidates, {PLAIN}" in md
    assert f"torch.distributed.pipelining candidates, {PEERLINE_UNDER_TORCH}" in md
    assert "ScheduleZBVZeroBubble with compiled blocks not tried" in md
