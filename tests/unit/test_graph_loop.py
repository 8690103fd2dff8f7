"""CPU checks of --graph-loop (cudagraph/loop.py, the launch planning of cudagraph/policy.py): the data ring, when a
launch runs K iterations, the flag's validation and its CPU notice. The looped graph itself needs a GPU
(tests/gpu/test_graph_loop_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.cudagraph.loop import DataRing
from peerline.distributed.cudagraph.policy import iterations_this_launch
from peerline.distributed.pipeline.engine import DataFeed
from peerline.launch.cli import build_parser, config_from_args
from tests.unit.fake_cuda_graph import FakeRuntime, reaches

pytestmark = pytest.mark.timeout(60)


def _feed(microbatches: int = 3, seed: int = 11) -> DataFeed:
    shape = (2, 5, 7)
    return DataFeed(seed=seed, replica=1, microbatches=microbatches,
                    inputs=[torch.full(shape, float("nan")) for _ in range(microbatches)],
                    targets=[torch.full(shape, float("nan")) for _ in range(microbatches)],
                    generator=torch.Generator())


def test_ring_slot_copied_to_static_buffers_is_that_iterations_data():
    feed, ref = _feed(), _feed()
    ring = DataRing(feed, slots=4, device=torch.device("cpu"))
    for r in ring.inputs + ring.targets:
        r.fill_(float("nan"))  # poisoned: load must write every slot it is asked for
    ring.load(first_iteration=7, count=4)
    for j in (2, 0, 3, 1):  # any slot order: the slot is read from the device tensor
        ring.slot.fill_(j)
        for b in feed.inputs + feed.targets:
            b.fill_(float("nan"))
        ring.copy_to_static()
        ref.load(7 + j)
        for got, want in zip(feed.inputs + feed.targets, ref.inputs + ref.targets, strict=True):
            assert torch.equal(got, want), j
    # Different iterations got different data (a slot left stale would repeat one).
    assert not torch.equal(ring.inputs[0][0], ring.inputs[0][1])


def test_ring_refuses_bad_counts():
    ring = DataRing(_feed(), slots=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot load 3 iterations"):
        ring.load(0, 3)
    with pytest.raises(ValueError, match=">= 1 slots"):
        DataRing(_feed(), slots=0, device=torch.device("cpu"))


@pytest.mark.parametrize("iteration,target,stops,loop,timeline,want", [
    (0, 100, (1,), 4, False, 1),      # the loss is read after every iteration: never loop
    (3, 100, (4,), 4, False, 1),      # 3 + 4 passes the read after iteration 4
    (4, 100, (4,), 4, False, 4),      # 4..7, read after 8
    (4, 100, (8,), 4, False, 4),
    (8, 10, (8,), 4, False, 1),       # only 2 left before the end
    (0, 8, (8,), 8, True, 1),         # the last iteration is the eager timeline one
    (8, 24, (8, 12), 4, False, 4),    # a checkpoint at 12: 8..11 fits
    (10, 24, (8, 12), 4, False, 1),   # 10 + 4 passes the checkpoint at 12
    (5, 100, (4,), 1, False, 1),      # no loop
])
def test_iterations_this_launch(iteration, target, stops, loop, timeline, want):
    assert iterations_this_launch(iteration, target, stops, loop, timeline) == want


@pytest.mark.parametrize("kwargs,match", [
    ({"graph_loop": 0}, "--graph-loop must be >= 1"),
    ({"graph_loop": 4, "log_every": 6}, "--log-every must be a multiple"),
    ({"graph_loop": 4, "log_every": 4, "staging": "pinned"}, "--staging direct"),
])
def test_graph_loop_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**kwargs)


def test_cli_log_every_defaults_to_the_loop():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--graph-loop", "8"])).log_every == 8
    assert config_from_args(parser.parse_args([])).log_every == 1
    assert config_from_args(parser.parse_args(["--graph-loop", "4", "--log-every", "12"])).log_every == 12
    with pytest.raises(ConfigError, match="multiple"):
        config_from_args(parser.parse_args(["--graph-loop", "4", "--log-every", "2"]))


def test_cpu_ignores_the_loop_with_a_notice_and_trains_the_same():
    from peerline.distributed.runtime import Runtime

    def train(loop: int) -> tuple[list[float], list[str]]:
        cfg = RunConfig(hidden=16, layers=2, seq=4, micro_batch_size=2, microbatches=2, iters=8, device="cpu",
                        seed=4, graph_loop=loop, log_every=4)
        rt = Runtime.create(cfg)
        try:
            assert rt.graph_loop == 1
            return rt.train(), rt.notices
        finally:
            rt.close()

    looped, notices = train(4)
    plain, plain_notices = train(1)
    assert looped == plain and len(looped) == 2
    assert any("--graph-loop 4 is ignored on the CPU" in n for n in notices)
    assert not any("graph-loop" in n for n in plain_notices)


def test_event_nodes_become_empty_nodes_that_keep_the_order():
    from peerline.distributed.cudagraph.edit import without_event_nodes

    # stream A: k1 -> record(e7) -> k2 ; stream B: k3 -> wait(e7) -> k4 ; a timing record (e9) nobody waits for.
    nodes = {1: ("Kernel", None), 2: ("EventRecord", 7), 3: ("Kernel", None), 4: ("Kernel", None),
             5: ("WaitEvent", 7), 6: ("Kernel", None), 8: ("EventRecord", 9)}
    edges = {(1, 2), (2, 3), (4, 5), (5, 6), (3, 8)}
    rt = FakeRuntime(nodes, edges)
    copy, removed = without_event_nodes(rt, 1)
    got_nodes, got_edges = rt.graphs[copy]
    assert removed == 3
    assert sorted(k for k, _ in got_nodes.values()) == ["Empty"] * 3 + ["Kernel"] * 4
    assert reaches(got_edges, 1, 3) and reaches(got_edges, 4, 6)  # each stream's own order kept
    assert reaches(got_edges, 1, 6)  # k4's stream waited for e7, recorded after k1: now an edge
    assert not reaches(got_edges, 6, 1)
    assert rt.graphs[1][0] == nodes  # the original graph (torch's, used for single replays) is untouched
