"""CPU smoke test of launch/bench.py's checkpoint suite (one process, --quick): the file comparison's two records and
the training part's three (training time lost per save, async vs sync; save and load GB/s per rank), valid and
finite, with every rank's figures in extra."""

import pytest

from tests.multiproc.test_bench_pipeline import records, run_bench

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_checkpoint_suite_quick_on_one_rank(tmp_path):
    out = tmp_path / "bench"
    folder = tmp_path / "not" / "yet"  # --checkpoint-dir names a folder to write into: made where missing
    proc = run_bench(1, ["--checkpoint-dir", str(folder)], out, suites=("checkpoint",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert folder.is_dir() and not any(folder.iterdir())  # its temporary folders are gone
    recs = {r["case"]: r for r in records(out, "checkpoint")}
    assert set(recs) == {"save", "load", "training time lost per save, async vs sync",
                         "save GB/s per rank, background write vs synchronous save",
                         "load GB/s per rank (resume: verify and read)"}, sorted(recs)
    lost = recs["training time lost per save, async vs sync"]
    assert lost["metric"] == "s" and lost["anchor_name"] == "synchronous save"
    assert set(lost["extra"]["block_medians_s"]) == {"none", "sync", "async"}
    assert lost["sizes"]["pp"] == 1 and lost["sizes"]["iterations_between_saves"] >= 3
    (rank0,) = lost["extra"]["per_rank"]
    assert rank0["bytes"] > 0 and len(rank0["write_s"]) == 1 and rank0["load_s"] > 0
    saves = recs["save GB/s per rank, background write vs synchronous save"]["extra"]
    assert len(saves["write_GBps"]) == len(saves["sync_save_GBps"]) == 1
