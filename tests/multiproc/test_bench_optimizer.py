"""CPU smoke test of launch/bench.py's optimizer suite (gloo, 2 ranks: dp=2): the four variants (DDP +
ZeroRedundancyOptimizer, peerline unsharded, peerline --shard-optimizer, with --overlap-param-gather) start from the
same weights and data, so their first losses agree; the records validate and the sharded optimizer state per rank
is about half."""

import json

import pytest

from tests.multiproc.test_bench_pipeline import records, run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_optimizer_suite_quick_on_two_ranks(tmp_path):
    out = tmp_path / "bench"
    proc = run_bench(2, [], out, suites=("optimizer",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = {r["case"]: r for r in records(out, "optimizer")}
    assert set(recs) == {"quick pp=1 dp=2 sharded vs allreduce", "quick pp=1 dp=2 sharded vs zero",
                         "quick pp=1 dp=2 overlap vs allreduce", "quick pp=1 dp=2 overlap vs zero",
                         "quick pp=1 dp=2 optimizer state per rank"}, sorted(recs)
    ex = recs["quick pp=1 dp=2 sharded vs zero"]["extra"]
    for name in ("zero", "allreduce"):
        assert max(abs(a - b) for a, b in zip(ex["sharded_losses"], ex[f"{name}_losses"], strict=True)) <= 1e-6
    assert ex["overlap_losses"] == ex["sharded_losses"]  # the overlapped all-gather copies the same values
    assert 1.8 <= recs["quick pp=1 dp=2 optimizer state per rank"]["ratio"] <= 2.0
    assert json.loads((out / "results.jsonl").read_text().splitlines()[0])["suite"] == "optimizer"
