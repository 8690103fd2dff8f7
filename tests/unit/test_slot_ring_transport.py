"""The real CopyEngineTransport code, run for two ranks in one process against a simulated GPU.

CUDA is replaced at the seams the transport uses (ipc: allocations, IPC handles, copies; stream_ops: flag waits and
writes; torch streams; the handle exchange): allocations are host tensors at fake device addresses, IPC handles
encode those addresses, and every stream operation is queued and later executed by a scheduler that interleaves
the four streams (compute and p2p of both ranks) at random, blocking on waits. This checks on the CPU what would
otherwise hang a GPU: that every address resolves to the right word or slot of the right rank, that messages land
intact, that flags return to their initial state, and that a too-shallow ring blocks.
"""

from __future__ import annotations

import ctypes
import random
import threading
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from peerline.distributed.p2p import copy_engine as ce
from peerline.distributed.p2p import flag_ops as stream_ops
from peerline.distributed.p2p import ipc
from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec
from peerline.distributed.streams import RankStreams

pytestmark = pytest.mark.timeout(60)


class Sim:
    """Fake device memory plus four stream queues and a random scheduler."""

    def __init__(self) -> None:
        self.allocs: dict[int, torch.Tensor] = {}
        self.next_addr = 1 << 40
        self.streams: dict[int, FakeStream] = {}
        self.local = threading.local()
        self.compute = [FakeStream(self, f"compute{r}") for r in range(2)]
        self.p2p = [FakeStream(self, f"p2p{r}") for r in range(2)]
        # optional extra send lanes: lanes[r][i] is rank r's (i+2)-th lane
        self.lanes = [[FakeStream(self, f"lane{r}.{i}") for i in range(3)] for r in range(2)]
        self.lane = [ls[0] for ls in self.lanes]
        self.batches: list[int] = []  # sizes of the flag-op batches issued
        self.drop_event_waits = False  # a broken transport, to show the tests catch a missing event wait

    # memory
    def alloc(self, nbytes: int) -> tuple[int, torch.Tensor]:
        base = self.next_addr
        self.next_addr += nbytes + (1 << 20)
        self.allocs[base] = torch.zeros(nbytes, dtype=torch.uint8)
        return base, self.allocs[base]

    def resolve(self, addr: int, n: int) -> tuple[torch.Tensor, int]:
        for base, t in self.allocs.items():
            if base <= addr and addr + n <= base + t.numel():
                return t, addr - base
        raise AssertionError(f"address {addr:#x} (+{n}) is in no allocation")

    def word(self, addr: int) -> torch.Tensor:
        t, off = self.resolve(addr, 4)
        assert off % 4 == 0, "flag word not aligned"
        return t[off:off + 4].view(torch.int32)

    # execution
    def blocked(self, s: FakeStream) -> bool:
        op = s.queue[s.done]
        if op[0] == "wait":
            return int(self.word(op[1])[0]) != op[2]
        if op[0] == "after":
            return op[1].done < op[2]
        return False

    def step(self, s: FakeStream) -> None:
        op = s.queue[s.done]
        if op[0] == "write":
            self.word(op[1])[0] = op[2]
        elif op[0] == "copy":
            _, dst, src, n = op
            t, off = self.resolve(dst, n)
            ctypes.memmove(t.data_ptr() + off, src, n)
        elif op[0] == "call":
            op[1]()
        s.done += 1

    def run(self, seed: int) -> bool:
        """Run every queue to its end; False on deadlock (no stream can move)."""
        rng = random.Random(seed)
        streams = self.compute + self.p2p + self.lanes[0] + self.lanes[1]
        while True:
            live = [s for s in streams if s.done < len(s.queue)]
            if not live:
                return True
            ready = [s for s in live if not self.blocked(s)]
            if not ready:
                return False
            # Bias against the receiver's compute stream: a slow consumer.
            self.step(rng.choices(ready, weights=[0.3 if s is self.compute[1] else 1.0 for s in ready])[0])


class FakeStream:
    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name = sim, name
        self.cuda_stream = id(self)
        sim.streams[self.cuda_stream] = self
        self.queue: list[tuple] = []
        self.done = 0

    def wait_stream(self, other: FakeStream) -> None:
        self.queue.append(("after", other, len(other.queue)))

    def wait_event(self, event: FakeEvent) -> None:
        if not event.sim.drop_event_waits:
            self.queue.append(("after", *event.at))  # the record issued before this wait, as in CUDA

    def synchronize(self) -> None:
        pass

    def call(self, fn) -> None:
        self.queue.append(("call", fn))


class FakeEvent:
    """torch.cuda.Event: a record remembers its stream's queue position; a wait binds to the latest record."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.at: tuple[FakeStream, int] | None = None

    def record(self, stream: FakeStream) -> None:
        self.at = (stream, len(stream.queue))


class _NoDevice:
    """Stands in for torch.cuda.device (a class: torch checks isinstance against it)."""

    def __init__(self, device: object) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Sim:
    s = Sim()
    rank = lambda: s.local.rank  # noqa: E731

    class FakeAllocation:
        def __init__(self, nbytes: int, device: torch.device) -> None:
            self.nbytes, self.device = nbytes, device
            self.ptr, self.tensor = s.alloc(nbytes)

        def handle(self) -> bytes:
            return self.ptr.to_bytes(64, "little")

        def free(self) -> None:
            self.ptr = 0

    class FakeMapping:
        def __init__(self, handle: bytes, device: torch.device) -> None:
            self.ptr = int.from_bytes(handle, "little")

        def close(self) -> None:
            self.ptr = 0

    class FakeFlagOps:
        def wait_eq(self, stream: int, addr: int, value: int) -> None:
            s.streams[stream].queue.append(("wait", addr, value))

        def write(self, stream: int, addr: int, value: int) -> None:
            s.streams[stream].queue.append(("write", addr, value))

        def __init__(self) -> None:
            self.batching = True

        def batch(self, stream: int, ops: tuple) -> None:
            s.batches.append(len(ops) if self.batching else 1)
            for action, addr, value in ops:
                s.streams[stream].queue.append((action, addr, value))

        def probe_batch(self, stream: int, addr: int, value: int) -> bool:
            return True

        def probe_packed(self, stream: int, addr: int, value: int, read, sync) -> bool:
            return False  # the simulation's streams take the operations as tuples

        def forget(self) -> None:
            pass

    def copy_peer(dst, dst_dev, src, src_dev, n, stream, capture_safe) -> None:
        assert dst_dev == 1 - rank() and src_dev == rank()
        s.streams[stream].queue.append(("copy", dst, src, n))

    gathered: list = [None, None]
    barrier = threading.Barrier(2)

    def all_gather_object(out: list, obj, group=None) -> None:
        gathered[rank()] = obj
        barrier.wait()
        out[:] = list(gathered)
        barrier.wait()

    monkeypatch.setattr(ipc, "DeviceAllocation", FakeAllocation)
    monkeypatch.setattr(ipc, "PeerMapping", FakeMapping)
    monkeypatch.setattr(ipc, "copy_peer", copy_peer)
    monkeypatch.setattr(ipc, "device_uuid", lambda i: f"GPU-{i}")
    monkeypatch.setattr(ipc, "find_device", lambda u: int(u[4:]))
    monkeypatch.setattr(stream_ops, "FlagOps", FakeFlagOps)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", _NoDevice)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(s))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: s.compute[rank()])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(ce.CopyEngineTransport, "_on_device", lambda self, t: t.device.type == "cpu")
    return s


def build(sim: Sim, spec: TensorSpec, depth: int, lanes: int = 1, split: bool = False, decoupled: bool = False
          ) -> list[ce.CopyEngineTransport]:
    """Both ranks' transports, constructed concurrently (the handle exchange is collective)."""
    out: list = [None, None]
    errors: list = []

    def make(r: int) -> None:
        sim.local.rank = r
        links = Links(None, 1, None, spec) if r == 0 else Links(0, None, spec, None)
        streams = RankStreams(device=torch.device("cuda", r), stage_compute=[sim.compute[r]], p2p=sim.p2p[r])
        try:
            out[r] = ce.CopyEngineTransport(links, torch.device("cuda", r), depth, streams=streams, depth=depth,
                                            lanes=sim.lanes[r][:lanes - 1], split=split, decoupled=decoupled)
        except Exception as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def pattern(mb: int, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) * 3 + mb * 1000 + salt).view(shape)

def _consume(sim, tr, mb: int, shape, bad: list[int]) -> None:
    """Rank 1 receives activation `mb`, checks it on its compute stream (a wrong one lands in `bad`), releases
    the slot."""
    as_rank(sim, 1)
    (got,) = tr[1].exchange([], [(ACT, mb)])
    sim.compute[1].call(lambda: bad.append(mb) if not torch.equal(got, pattern(mb, shape)) else None)
    tr[1].release(ACT, mb)



def as_rank(sim: Sim, r: int) -> None:
    sim.local.rank = r


@pytest.fixture
def small_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split even the tiny messages of these tests, at 4-byte boundaries."""
    monkeypatch.setattr(ce, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(ce, "SPLIT_ALIGN", 4)


VARIANTS = [(1, 1, False), (2, 1, False), (3, 1, False), (2, 2, False), (3, 2, False), (4, 2, False),
            (1, 2, True), (2, 2, True), (3, 2, True), (4, 4, True), (3, 4, True), (4, 3, False)]


@pytest.mark.parametrize(("depth", "lanes", "split"), VARIANTS)
def test_one_way_messages_land_intact(sim: Sim, small_split: None, depth: int, lanes: int, split: bool) -> None:
    shape = (3, 5)
    tr = build(sim, TensorSpec(shape, torch.float32), depth, lanes, split)
    m, bad, keep = 9, [], []
    for mb in range(m):
        as_rank(sim, 0)
        x = pattern(mb, shape)
        keep.append(x)  # host memory must outlive the simulated copy (record_stream does this on a GPU)
        tr[0].exchange([(ACT, mb, x)], [])
        _consume(sim, tr, mb, shape, bad)
    as_rank(sim, 0)
    tr[0].finish_iteration()
    assert sim.run(seed=depth)
    assert bad == []
    assert tr[0].idle() and tr[1].idle()
    assert tr[0].capacity == depth
    copies = {st.name: sum(op[0] == "copy" for op in st.queue) for st in [sim.p2p[0], *sim.lanes[0]]}
    if split:  # every message in two halves, one per lane of its group
        assert sum(copies.values()) == 2 * m and copies["lane0.0"] > 0
        groups = lanes // 2  # group g = lanes (2g, 2g+1); lane0.2 is the second lane of group 1
        assert copies["lane0.2"] == sum((mb % depth) % groups == 1 for mb in range(m))
    else:  # whole messages, round robin over min(lanes, depth) lanes
        assert sum(copies.values()) == m
        assert (copies["lane0.0"] > 0) == (lanes >= 2 and depth > 1)
    assert 2 in sim.batches  # wait + clear issued as one batch


@pytest.mark.parametrize(("lanes", "split", "decoupled"), [(1, False, False), (2, False, False), (2, True, False),
                                                          (4, True, False), (3, False, True), (4, False, True)])
def test_both_directions_in_one_exchange(sim: Sim, small_split: None, lanes: int, split: bool, decoupled: bool
                                         ) -> None:
    shape = (4, 4)
    tr = build(sim, TensorSpec(shape, torch.float32), 2, lanes, split, decoupled)
    n, bad, keep = 6, [], []
    answers: dict[int, torch.Tensor] = {}
    for i in range(n + 1):
        as_rank(sim, 0)
        sends = [(ACT, i, pattern(i, shape))] if i < n else []
        keep += [t for _, _, t in sends]
        got = tr[0].exchange(sends, [(GRAD, i - 1)] if i else [])
        if got:
            sim.compute[0].call(lambda g=got[0], i=i: bad.append(("grad", i - 1))
                                if not torch.equal(g, pattern(i - 1, shape) * 2 + 1) else None)
            tr[0].release(GRAD, i - 1)
        as_rank(sim, 1)
        got = tr[1].exchange([(GRAD, i - 1, answers[i - 1])] if i else [], [(ACT, i)] if i < n else [])
        if got:
            ans = torch.empty(shape)  # filled by the consumer on the compute stream, sent in the next step
            answers[i] = ans

            def consume(g=got[0], i=i, ans=ans) -> None:
                if not torch.equal(g, pattern(i, shape)):
                    bad.append(("act", i))
                ans.copy_(g * 2 + 1)
            sim.compute[1].call(consume)
            tr[1].release(ACT, i)
    for r in range(2):
        as_rank(sim, r)
        tr[r].finish_iteration()
    assert sim.run(seed=5)
    assert bad == []
    assert tr[0].idle() and tr[1].idle()


def stream_rounds(sim: Sim, tr: list[ce.CopyEngineTransport], shape: tuple[int, ...], rounds: int, m: int
                  ) -> list[int] | None:
    """`rounds` times: queue m messages rank 0 -> rank 1 (produced on the sender's compute stream, checked on the
    receiver's), then run the simulation with a new seed. Returns the microbatches that arrived wrong, None on a
    deadlock."""
    bad: list[int] = []
    keep = []
    for r in range(rounds):
        for mb in range(r * m, (r + 1) * m):
            as_rank(sim, 0)
            keep.append(torch.full(shape, float("nan")))  # host memory must outlive the simulated copy
            # produced on the sender's compute stream: the copy must wait for it
            sim.compute[0].call(lambda x=keep[-1], mb=mb: x.copy_(pattern(mb, shape)))
            tr[0].exchange([(ACT, mb, keep[-1])], [])
            _consume(sim, tr, mb, shape, bad)
        as_rank(sim, 0)
        tr[0].finish_iteration()
        if not sim.run(seed=r):
            return None
    return bad


@pytest.mark.parametrize(("depth", "lanes"), [(1, 3), (2, 3), (4, 3), (2, 4), (3, 4), (4, 4)])
def test_decoupled_flags_keep_the_copy_lanes_free_of_flag_operations(sim: Sim, depth: int, lanes: int) -> None:
    shape = (3, 5)
    tr = build(sim, TensorSpec(shape, torch.float32), depth, lanes, decoupled=True)
    assert stream_rounds(sim, tr, shape, rounds=4, m=9) == []
    assert tr[0].idle() and tr[1].idle()
    streams = [sim.p2p[0], *sim.lanes[0][:lanes - 1]]
    *copy_lanes, free, full = streams
    kinds = {st.name: {op[0] for op in st.queue} for st in streams}
    for lane in copy_lanes:  # only copies, plus the waits for the producer and for E_free
        assert kinds[lane.name] == {"copy", "after"}
    assert "copy" not in kinds[free.name] and "copy" not in kinds[full.name]
    assert sum(op[0] == "wait" for op in free.queue) == 36  # every FREE wait on the FREE stream
    assert sum(op[0] == "write" for op in full.queue) == 36  # every FULL write on the FULL stream
    copies = [sum(op[0] == "copy" for op in lane.queue) for lane in copy_lanes]
    assert copies == [sum(mb % depth % len(copy_lanes) == i for mb in range(36)) for i in range(len(copy_lanes))]
    assert "decoupled flags" in tr[0].describe()


def test_decoupled_flags_without_the_event_waits_are_caught(sim: Sim) -> None:
    """The simulation must notice a copy lane that does not wait for E_free and a FULL written before E_copied:
    wrong data, or a deadlock (a FULL written early is cleared by the receiver's previous use of the slot)."""
    shape = (3, 5)
    sim.drop_event_waits = True
    tr = build(sim, TensorSpec(shape, torch.float32), 2, 3, decoupled=True)
    assert stream_rounds(sim, tr, shape, rounds=8, m=9) != []


@pytest.mark.parametrize(("lanes", "split"), [(2, False), (4, True)])
def test_decoupled_flags_need_three_lanes_and_no_split(sim: Sim, lanes: int, split: bool) -> None:
    with pytest.raises(ValueError, match="decoupled flags need >= 3 p2p lanes"):
        build(sim, TensorSpec((2, 2), torch.float32), 2, lanes=lanes, split=split, decoupled=True)


def test_gpipe_with_a_shallow_ring_deadlocks(sim: Sim) -> None:
    """Receiver holds all 3 messages before releasing any: a ring of 2 blocks (and a ring of 3 would not)."""
    shape = (2,)
    tr = build(sim, TensorSpec(shape, torch.float32), 2)
    keep = []
    as_rank(sim, 0)
    for mb in range(3):
        keep.append(pattern(mb, shape))
        tr[0].exchange([(ACT, mb, keep[-1])], [])
    as_rank(sim, 1)
    tr[1].exchange([], [(ACT, 0)])
    tr[1].exchange([], [(ACT, 1)])
    with pytest.raises(RuntimeError, match="still holds mb 0"):
        tr[1].exchange([], [(ACT, 2)])  # the host sees the clash before queuing a wait that could never end
    assert not sim.run(seed=0)  # and on the device the third copy waits for a slot forever


def test_host_side_errors(sim: Sim) -> None:
    tr = build(sim, TensorSpec((2, 2), torch.float32), 2)
    as_rank(sim, 0)
    with pytest.raises(ValueError, match="expects"):
        tr[0].exchange([(ACT, 0, torch.zeros(2, 3))], [])
    with pytest.raises(ValueError, match="expects"):
        tr[0].exchange([(ACT, 0, torch.zeros(2, 2, dtype=torch.float64))], [])
    with pytest.raises(ValueError, match="no copy-engine edge"):
        tr[0].exchange([], [(ACT, 0)])
    with pytest.raises(ValueError, match="no copy-engine edge"):
        tr[0].exchange([(GRAD, 0, torch.zeros(2, 2))], [])
    as_rank(sim, 1)
    with pytest.raises(ValueError, match="not received"):
        tr[1].release(ACT, 0)
    with pytest.raises(RuntimeError, match="still holds"):
        tr[1].exchange([], [(ACT, 0), (ACT, 2)])  # same slot twice in one group
    assert all(not s.queue for s in sim.compute + sim.p2p)  # nothing was queued by the failed calls
    assert "act<-0" in tr[1].describe() and "act->1" in tr[0].describe()


def test_split_needs_an_even_number_of_lanes(sim: Sim) -> None:
    with pytest.raises(ValueError, match="even number of p2p lanes"):
        build(sim, TensorSpec((2, 2), torch.float32), 2, lanes=3, split=True)


def test_mismatched_depths_fail_on_every_rank(sim: Sim) -> None:
    out, errors = [None, None], []

    def make(r: int) -> None:
        sim.local.rank = r
        spec = TensorSpec((2,), torch.float32)
        links = Links(None, 1, None, spec) if r == 0 else Links(0, None, spec, None)
        streams = RankStreams(device=torch.device("cuda", r), stage_compute=[sim.compute[r]], p2p=sim.p2p[r])
        try:
            out[r] = ce.CopyEngineTransport(links, torch.device("cuda", r), 2, streams=streams, depth=2 + r)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("disagree on the ring depth" in e for e in errors)


def test_reset_forgets_host_state_after_an_abandoned_capture(sim: Sim) -> None:
    tr = build(sim, TensorSpec((2,), torch.float32), 2)
    as_rank(sim, 1)
    tr[1].exchange([], [(ACT, 0)])  # as if captured: the receive was recorded, the release never came
    with pytest.raises(RuntimeError, match="still holds"):
        tr[1].exchange([], [(ACT, 2)])
    tr[1].reset()
    tr[1].exchange([], [(ACT, 2)])  # accepted again
    flags = tr[1]._flags.tensor.view(torch.int32)
    flags.fill_(7)
    tr[1].reset(flags=True)  # no process group in the fake: the barriers are skipped
    assert tr[1].idle()
