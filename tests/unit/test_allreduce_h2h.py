"""The head-to-head summary of the allreduce suite: medians per variant, paired ratios per round, rounds won; the
shape names. (The rounds themselves run in tests/multiproc/test_buckets_bench.py and on the GPU.)"""

from __future__ import annotations

import pytest

from peerline.bench.suites.allreduce_h2h import _summarize, h2h_shapes
from peerline.bench.suites.allreduce_workload import Shape


def test_summary_pairs_each_round_with_ddp() -> None:
    rows = [{"DDP": 10.0, "peerline eager": 9.0, "peerline graph": 11.0},
            {"DDP": 12.0, "peerline eager": 12.5, "peerline graph": 10.0},
            {"DDP": 11.0, "peerline eager": 10.0, "peerline graph": 10.5}]
    s = _summarize(rows, ["DDP", "peerline eager", "peerline graph"])
    assert s["peerline eager"]["median_ms"] == 10.0 and s["DDP"]["median_ms"] == 11.0
    # paired ratios DDP / eager: 1.111, 0.96, 1.1 -> median 1.1, won 2 of 3
    assert s["peerline eager"]["ratio"] == pytest.approx(1.1) and s["peerline eager"]["won"] == 2
    assert s["peerline graph"]["ratio_min"] == pytest.approx(10 / 11) and s["peerline graph"]["won"] == 2
    assert s["DDP"]["ratio"] == 1.0 and s["DDP"]["won"] == 0


def test_shape_names() -> None:
    anchor = Shape()
    shapes = h2h_shapes("anchor,launch", anchor, quick=False)
    assert shapes["anchor"] is anchor and shapes["launch"].hidden == 512 and shapes["launch"].microbatches == 4
    assert h2h_shapes("none", anchor, quick=False) == {}
    with pytest.raises(SystemExit, match="unknown --ar-h2h-shapes warp"):
        h2h_shapes("anchor,warp", anchor, quick=False)
