"""The training loop's extension points (distributed/hooks.py, runtime.py) on the CPU: the order in which
`Runtime.train` calls its hooks around each launch, looped launches ending at every hook's stops, the eager
timeline iteration, errors reaching every hook, hook factories at `Runtime.create`, and the engine telling its
exchange observer about every exchange with another rank. The runtime's loop runs over a fake engine and graph
here; the last tests use the real assembly and engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.assemble import Grid, RunParts
from peerline.distributed.config import RunConfig
from peerline.distributed.cudagraph.policy import GraphPolicy
from peerline.distributed.env import LaunchInfo
from peerline.distributed.hooks import IterationHooks, IterationStats
from peerline.distributed.mesh import Mesh
from peerline.distributed.runtime import Runtime

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


class Recorder(IterationHooks):
    """Appends (name, call, args) of every hook call to a shared event list."""

    def __init__(self, name: str, events: list, stops: tuple[int, ...] = ()) -> None:
        self.name, self.events, self.launch_stops = name, events, stops

    def on_train_start(self, rt) -> None:
        self.events.append((self.name, "start"))

    def before_launch(self, rt, first_iteration: int, n: int) -> None:
        self.events.append((self.name, "before", first_iteration, n))

    def after_launch(self, rt, last_iteration: int) -> None:
        self.events.append((self.name, "after", last_iteration))

    def on_logged(self, rt, stats: IterationStats) -> None:
        self.events.append((self.name, "logged", stats.iteration))

    def on_train_end(self, rt) -> None:
        self.events.append((self.name, "end"))

    def on_error(self, rt, exc: BaseException) -> None:
        self.events.append((self.name, "error", str(exc)))


class FakeFeed:
    def __init__(self, events: list) -> None:
        self.events = events

    def load(self, iteration: int) -> None:
        self.events.append(("feed", "load", iteration))


class FakeTransport:
    def describe(self) -> str:
        return "fake"

    def close(self) -> None:
        pass


class FakeEngine:
    """What the runtime's loop touches of an Engine: no streams (the CPU), a feed, iteration(), the loss."""

    main_stream = None

    def __init__(self, events: list) -> None:
        self.events = events
        self.feed = FakeFeed(events)
        self.transport = FakeTransport()
        self.stages = {0: type("Stage", (), {"is_last": True})()}
        self.loss_sum = torch.tensor(0.5)

    def iteration(self) -> None:
        self.events.append(("engine", "iteration"))

    def finish_parameter_gathers(self) -> None:
        """Nothing to gather (no --overlap-param-gather)."""


class FakeGraph:
    """A captured iteration as the runtime uses it: load + replay one iteration, or run_loop K of them."""

    def __init__(self, events: list, loop: int) -> None:
        self.events, self.loop_iterations = events, loop
        self.loop = object() if loop > 1 else None

    def load(self, iteration: int) -> None:
        self.events.append(("graph", "load", iteration))

    def replay(self) -> None:
        self.events.append(("graph", "replay"))

    def run_loop(self, first_iteration: int) -> int:
        self.events.append(("graph", "loop", first_iteration))
        return self.loop_iterations

    def release(self) -> None:
        pass


def fake_runtime(events: list, hooks: list[IterationHooks], *, loop: int = 0, timeline: bool = False,
                 **cfg: object) -> Runtime:
    """A Runtime over a fake engine; with `loop` >= 1 a fake captured graph (a looped one when loop > 1)."""
    config = RunConfig(device="cpu", **cfg)
    info = LaunchInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                      master_port=0, launcher="single")
    grid = Grid(info=info, device=CPU, mesh=Mesh(pp=1, dp=1, rank=0), n_stages=1, stage_ids=[0], programs=[])
    graphs = GraphPolicy(device=CPU, rank=0, graph=None, warmup_iters=1, loop=max(loop, 1), eager_last=timeline)
    if loop:
        graphs.graph = FakeGraph(events, loop)
    parts = RunParts(cfg=config, grid=grid, engine=FakeEngine(events), streams=None, links=None, split="",
                     layer_offsets={0: 0}, graphs=graphs, hooks=list(hooks))
    return Runtime(parts)


def test_hooks_run_in_order_around_each_eager_launch():
    events: list = []
    rt = fake_runtime(events, [Recorder("a", events), Recorder("b", events)], iters=4, log_every=2)
    got: list[IterationStats] = []
    losses = rt.train(on_iteration=lambda s: events.append(("caller", "logged", s.iteration)) or got.append(s))
    want = [("a", "start"), ("b", "start")]
    for it in range(4):
        want += [("a", "before", it + 1, 1), ("b", "before", it + 1, 1),
                 ("feed", "load", it), ("engine", "iteration"),
                 ("b", "after", it + 1), ("a", "after", it + 1)]
        if (it + 1) % 2 == 0:  # --log-every 2: hooks first, in list order, then the caller
            want += [("a", "logged", it + 1), ("b", "logged", it + 1), ("caller", "logged", it + 1)]
    want += [("b", "end"), ("a", "end")]
    assert events == want
    assert losses == [0.5, 0.5] and [s.iteration for s in got] == [2, 4] and rt.iteration == 4


def test_looped_launches_end_at_every_hooks_stops():
    events: list = []
    rt = fake_runtime(events, [Recorder("ckpt", events, stops=(6,))], loop=4, iters=16, log_every=8)
    rt.train()
    launches = [(e[2], e[3]) for e in events if e[1] == "before"]
    # Contiguous launches from iteration 1 to 16; no launch runs past a multiple of 6 (the hook's stop) or of 8
    # (the loss read), and the room between them is used by K=4 loops.
    assert [first for first, _ in launches] == [1] + [f + n for f, n in launches[:-1]]
    assert launches[-1][0] + launches[-1][1] - 1 == 16
    for first, n in launches:
        last = first + n - 1
        assert not any(s % 6 == 0 or s % 8 == 0 for s in range(first, last)), (first, n)
    # Loops where four iterations fit: 1-4, 9-12, 13-16 (5-8 one by one: a loop would pass the stop at 6 or 8).
    assert [first for first, n in launches if n == 4] == [1, 9, 13]
    # A loop is one launch of the graph; a single iteration is a load and a replay; the feed is never used.
    loops = [e[2] for e in events if e[:2] == ("graph", "loop")]
    assert loops == [first - 1 for first, n in launches if n == 4]
    assert sum(e[:2] == ("graph", "replay") for e in events) == sum(n == 1 for _, n in launches)
    assert not any(e[0] == "feed" for e in events)


def test_the_timeline_iteration_runs_eager():
    events: list = []
    rt = fake_runtime(events, [], loop=1, timeline=True, iters=3)
    rt.train()
    runs = [e[:2] for e in events if e[1] in ("replay", "iteration")]
    assert runs == [("graph", "replay"), ("graph", "replay"), ("engine", "iteration")]


def test_an_error_reaches_every_hook_in_reverse_and_propagates():
    events: list = []

    class Boom(Recorder):
        def after_launch(self, rt, last_iteration: int) -> None:
            super().after_launch(rt, last_iteration)
            if last_iteration == 2:
                raise RuntimeError("lost peer")

    rt = fake_runtime(events, [Recorder("a", events), Boom("b", events)], iters=4)
    with pytest.raises(RuntimeError, match="lost peer"):
        rt.train()
    assert events[-3:] == [("b", "after", 2), ("b", "error", "lost peer"), ("a", "error", "lost peer")]
    assert not any(e[1] == "end" for e in events)


def tiny(**kw: object) -> RunConfig:
    return RunConfig(hidden=16, layers=2, seq=4, micro_batch_size=2, microbatches=2, iters=4, device="cpu", seed=5,
                     **kw)


def test_create_makes_hooks_from_the_built_runtime_and_they_change_nothing():
    events: list = []
    made: list = []

    def factory(rt: Runtime) -> IterationHooks:
        made.append(rt)
        return Recorder("r", events)

    rt = Runtime.create(tiny(log_every=2), hooks=[factory])
    try:
        assert made == [rt] and rt.hooks[-1].name == "r"
        losses = rt.train()
    finally:
        rt.close()
    plain = Runtime.create(tiny(log_every=2))
    try:
        assert plain.train() == losses
    finally:
        plain.close()
    assert [e for e in events if e[1] == "before"] == [("r", "before", i, 1) for i in range(1, 5)]
    assert [e[2] for e in events if e[1] == "logged"] == [2, 4]


def test_a_failing_factory_closes_the_runtime():
    closed = []

    def factory(rt: Runtime) -> IterationHooks:
        real = rt.engine.transport.close
        rt.engine.transport.close = lambda: closed.append(True) or real()  # observe the teardown
        raise ValueError("bad hook")

    with pytest.raises(ValueError, match="bad hook"):
        Runtime.create(tiny(), hooks=[factory])
    assert closed == [True]


def test_engine_tells_its_observer_about_every_exchange_in_order():
    """Stage 0 of two, the other stage remote: every send/receive goes through the transport, between the
    observer's on_exchange and after_exchange."""
    from peerline.distributed.p2p.base import TensorSpec, Transport
    from peerline.distributed.pipeline import schedule as sched
    from peerline.distributed.pipeline.engine import DataFeed, Engine, LocalStage

    events: list = []
    spec = TensorSpec((2, 4), torch.float32)

    class Loopback(Transport):
        name = "loopback"

        def exchange(self, sends, recvs):
            events.append(("transport", [(k, mb) for k, mb, _ in sends], list(recvs)))
            return [torch.ones(spec.shape) for _ in recvs]

    class Observer:
        def on_exchange(self, sends, recvs, send_labels, recv_labels):
            assert len(send_labels) == len(sends) and len(recv_labels) == len(recvs)
            assert [mb for _k, _b, mb in send_labels] == [mb for _k, mb, _ in sends]  # one stage per rank: id = mb
            events.append(("on", [(k, mb) for k, mb, _ in sends], list(recvs)))

        def after_exchange(self, sends, recvs, received):
            assert len(received) == len(recvs)
            events.append(("after", [(k, mb) for k, mb, _ in sends], list(recvs)))

    class NoSync:
        def zero_grad(self): pass
        def arm(self): pass
        def finish(self): pass
        def metrics(self): return {}

    module = nn.Sequential(nn.Linear(4, 4))
    stage = LocalStage(index=0, n_stages=2, module=module, stream=None, out_spec=spec, grad_sync=NoSync())
    order = sched.simulate(sched.build("gpipe", 2, 2), Loopback.capacity)
    feed = DataFeed(seed=0, replica=0, microbatches=2, inputs=[torch.zeros(spec.shape) for _ in range(2)],
                    targets=[], generator=torch.Generator())
    engine = Engine(stages=[stage], program=[(s, step) for s, step in order if s == 0], transport=Loopback(),
                    optimizer=torch.optim.SGD(module.parameters(), lr=0.1), feed=feed, microbatches=2, device=CPU,
                    autocast_dtype=None)
    engine.exchange_observer = Observer()
    feed.load(0)
    engine.iteration()
    exchanges = [e for e in events if e[0] == "transport"]
    assert exchanges, "stage 0 of two exchanges with stage 1"
    assert events == [e for x in exchanges for e in (("on", *x[1:]), x, ("after", *x[1:]))]
