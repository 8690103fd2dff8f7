"""CPU smoke test of launch/bench.py's optimizer suite (gloo, 2 ranks: pp=1 x dp=2), both models at their quick
shapes. Every row runs: torch DDP + AdamW and DDP + ZeroRedundancyOptimizer over the plain torch model, peerline
unsharded, --shard-optimizer, and with --overlap-param-gather. peerline's rows start from the same weights and data,
so their first losses agree, and so do the plain MLP's (it holds peerline's weights); the plain GPT has its own
init, so its two torch rows agree with each other. The records validate, the table has a line per row, the RATIO
lines are written and the sharded optimizer state per rank is about half."""

import json

import pytest

from tests.multiproc.test_bench_pipeline import records, run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
ROWS = ("ddp", "ddp-zero", "allreduce", "sharded", "overlap")


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_optimizer_suite_quick_on_two_ranks(tmp_path):
    out = tmp_path / "bench"
    proc = run_bench(2, ["--optimizer-model", "gpt,mlp"], out, suites=("optimizer",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = {r["case"]: r for r in records(out, "optimizer")}
    notes = (out / "results.md").read_text()
    expected = set()
    for model in ("gpt", "mlp"):
        grid = f"{model}-quick pp=1 dp=2"
        expected |= {f"{grid} {v} vs {b}" for v in ("sharded", "overlap") for b in ("allreduce", "ddp", "ddp-zero")}
        expected.add(f"{grid} optimizer state per rank")
        ex = recs[f"{grid} sharded vs ddp"]["extra"]
        assert recs[f"{grid} sharded vs ddp"]["sizes"]["model"] == model
        for row in ROWS:
            assert ex[f"{row}_ms"] > 0 and ex[f"{row}_tokens_per_s"] > 0, row
            assert len(ex[f"{row}_state_bytes"]) == 2, row
            assert f"optimizer {grid} row {row}: " in notes, row
        same = ("allreduce", "ddp", "ddp-zero") if model == "mlp" else ("allreduce",)
        for row in same:
            assert _max_diff(ex["sharded_losses"], ex[f"{row}_losses"]) <= 1e-6, (model, row)
        assert _max_diff(ex["ddp_losses"], ex["ddp-zero_losses"]) <= 1e-6, model
        assert ex["overlap_losses"] == ex["sharded_losses"]  # the overlapped all-gather copies the same values
        assert 1.8 <= recs[f"{grid} optimizer state per rank"]["ratio"] <= 2.0
        assert f"GOAL MET optimizer {grid}: sharded state per rank" in notes
        for variant in ("sharded", "overlap"):
            assert f"RATIO optimizer {grid}: {variant} step against torch" in notes
    assert set(recs) == expected, sorted(set(recs) ^ expected)
    assert json.loads((out / "results.jsonl").read_text().splitlines()[0])["suite"] == "optimizer"


def test_help_names_the_models_and_rows():
    from peerline.bench.cli import build_parser

    parser = build_parser()
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for flag in ("--optimizer-model", "--optimizer-configs", "--optimizer-variants", "--optimizer-dp",
                 "--optimizer-iters"):
        assert flag in helps and flag in parser.format_help(), flag
    assert "gpt" in helps["--optimizer-model"] and "mlp" in helps["--optimizer-model"]
    for row in ("ddp (torch DDP + AdamW)", "ddp-zero (DDP + ZeroRedundancyOptimizer)", "allreduce", "overlap"):
        assert row in helps["--optimizer-variants"], row
