"""CPU smoke tests of the one-GPU parts (a fresh process on rank 0's device while the other ranks wait:
fresh_child.run_fresh_child): the gpt suite's --gpt-single row on two gloo ranks (the whole plain
torch GPT eager with bf16 parameters against peerline --stages 1 --no-graph --precision bf16, the quick shape in
bf16) and the eager suite's one-GPU part on one rank. The bench runs from outside the checkout, so the child must
find peerline where its parent did."""

import math

import pytest

from tests.multiproc.test_bench_pipeline import records, run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def finite_positive(*values: float) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_gpt_single_row_on_two_ranks(tmp_path):
    out = tmp_path / "gpt"
    proc = run_bench(2, ["--gpt-variants", "eager", "--gpt-single"], out, suites=("gpt",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = {r["case"]: r for r in records(out, "gpt")}
    row = recs["quick one-GPU eager bf16"]
    assert row["metric"] == "tokens/s" and row["anchor_name"] == "plain torch GPT eager, one GPU"
    assert row["sizes"]["pp"] == 1 and row["sizes"]["dtype"] == "bf16" and row["sizes"]["microbatches"] == 4
    assert finite_positive(row["peerline"], row["anchor"], row["ratio"])
    ex = row["extra"]
    assert finite_positive(ex["ms_per_iter"], ex["anchor_ms_per_iter"])
    assert ex["flags"] == "--stages 1 --no-graph --precision bf16" and ex["anchor_model"] == "plain torch GPT"
    vocab = row["sizes"]["vocab"]
    for losses in (ex["losses"], ex["anchor_losses"]):  # two bf16 models of one shape from their own inits
        assert len(losses) == 2 and all(0.5 * math.log(vocab) < v < 1.5 * math.log(vocab) for v in losses), losses
    md = (out / "results.md").read_text()
    assert "| gpt | quick one-GPU eager bf16 | tokens/s |" in md
    assert "gpt quick one-GPU eager bf16: peerline --stages 1 --no-graph --precision bf16 " in md
    assert " ms/iter" in md.split("gpt quick one-GPU eager bf16: peerline")[1]


def test_eager_single_part_on_one_rank(tmp_path):
    out = tmp_path / "eager"
    proc = run_bench(1, ["--reps", "1", "--warmup", "0"], out, suites=("eager",))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = records(out, "eager")  # on the CPU: the autocast recipe only
    assert row["case"] == "quick 1 GPU peerline --stages 1 --no-graph --precision autocast vs plain torch"
    assert finite_positive(row["peerline"], row["anchor"])
    assert row["extra"]["peerline_losses"] == pytest.approx(row["extra"]["plain_losses"], rel=1e-5)
