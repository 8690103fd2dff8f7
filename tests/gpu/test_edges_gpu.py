"""Per-edge transports on GPUs: ranks told (PEERLINE_HOST_ID) that they run on different hosts use NCCL between
them, ranks of one host the copy engine, and the run still equals one GPU (fp32, 1e-5 relative; graph on and
off). On four GPUs pp=4 over hosts a,a,b,b mixes both: the middle ranks route each neighbour to its own transport.
The start-up line of every run must name each edge's transport and hosts."""

from __future__ import annotations

import re

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TINY = ("--hidden", "256", "--layers", "8", "--seq", "64", "--micro-batch-size", "2", "--iters", "5",
        "--warmup-iters", "2", "--schedule", "1f1b", "--dtype", "fp32")
REF = Run("edges_ref", (*TINY, "--no-graph", "-m", "8"))


def _edges_line(pipeline_runs, run: Run) -> str:
    log = (pipeline_runs.out / f"{run.name}.log").read_text(errors="replace")
    found = [line for line in log.splitlines() if line.startswith("peerline: p2p edges ")]
    assert len(found) == 1, f"expected one edges line in {run.name}.log, found {found}"
    return found[0]


@pytest.mark.gpu2
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
@pytest.mark.parametrize("hosts,transport", [("a,b", "nccl"), ("a,a", "copy-engine")])
def test_two_ranks_pick_by_host(pipeline_runs, hosts: str, transport: str, graph: str) -> None:
    run = Run(f"edges_{hosts.replace(',', '')}{graph.replace('-', '_')}", (*TINY, "--pp", "2", "-m", "8", graph),
              nproc=2, env=(("PEERLINE_HOST_ID", hosts),))
    got, ref = pipeline_runs.results(run, REF)
    assert_matches(got, ref, Expect(1e-5, world=2, graph=graph == "--graph", transport=transport))
    where = "a" if hosts == "a,a" else "a -> b"
    assert f"0-1 {transport} ({where})" in _edges_line(pipeline_runs, run)


@pytest.mark.gpu4
@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
def test_four_ranks_mix_transports(pipeline_runs, graph: str) -> None:
    run = Run(f"edges_aabb{graph.replace('-', '_')}", (*TINY, "--pp", "4", "-m", "8", graph), nproc=4,
              env=(("PEERLINE_HOST_ID", "a,a,b,b"),))
    got, ref = pipeline_runs.results(run, REF)
    assert_matches(got, ref, Expect(1e-5, world=4, graph=graph == "--graph", transport="copy-engine"))
    line = _edges_line(pipeline_runs, run)
    assert re.search(r"0-1 copy-engine \(a\), 1-2 nccl \(a -> b\), 2-3 copy-engine \(b\)", line), line
