"""Per-edge transport choice (distributed/p2p/edges.py) and the routed transport (p2p/routed.py), on the CPU:
host ids, the plan of every edge from the ranks' facts, and that a routed exchange sends each neighbour's
messages through its own transport in an order that cannot deadlock."""

from __future__ import annotations

import pytest
import torch

from peerline.distributed.config import ConfigError
from peerline.distributed.mesh import Mesh
from peerline.distributed.p2p import edges as E
from peerline.distributed.p2p.base import ACT, GRAD, Links, Transport
from peerline.distributed.p2p.collective import CollectiveTransport
from peerline.distributed.p2p.factory import make_edge_transport
from peerline.distributed.p2p.routed import RoutedTransport


def _facts(pp: int, dp: int, hosts: list[str], *, gpus: int = 8, usable: bool = True,
           peer_access: bool = True) -> list[E.RankFacts]:
    """Every rank of a pp x dp grid; rank r on GPU (its index within its host), all GPUs of a host peers."""
    facts = []
    for r in range(pp * dp):
        mesh = Mesh(pp=pp, dp=dp, rank=r)
        local = hosts[:r].count(hosts[r])
        peers = tuple(j for j in range(gpus) if j != local) if peer_access else ()
        facts.append(E.RankFacts(r, hosts[r], mesh.prev_rank, mesh.next_rank, local, peers, usable))
    return facts


def _kinds(edges: list[E.Edge]) -> dict[tuple[int, int], str]:
    return {(e.src, e.dst): e.transport for e in edges}


def test_host_id_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEERLINE_HOST_ID", raising=False)
    import socket

    assert E.host_id(3) == socket.gethostname()
    monkeypatch.setenv("PEERLINE_HOST_ID", "nodeA")
    assert E.host_id(0) == E.host_id(5) == "nodeA"
    monkeypatch.setenv("PEERLINE_HOST_ID", "a, a,b,b")
    assert [E.host_id(r) for r in range(4)] == ["a", "a", "b", "b"]
    with pytest.raises(ConfigError, match="none for rank 4"):
        E.host_id(4)


def test_plan_pp4_over_two_hosts() -> None:
    """Copy engine inside each host, NCCL on the edge that crosses; the same plan from any rank's view."""
    facts = _facts(4, 1, ["a", "a", "b", "b"])
    edges = E.plan_edges(facts, "auto", "cuda")
    assert _kinds(edges) == {(0, 1): "copy-engine", (1, 2): "nccl", (2, 3): "copy-engine"}
    assert [e.same_host for e in edges] == [True, False, True]
    assert E.neighbour_transports(edges, 1) == {0: "copy-engine", 2: "nccl"}
    assert E.same_host_ranks(facts, 2) == [2, 3]
    assert _kinds(E.plan_edges(list(reversed(facts)), "auto", "cuda")) == _kinds(edges)  # any order of facts
    assert E.describe_edges(edges) == ("p2p edges over 2 host(s), 1 across hosts: 0-1 copy-engine (a), "
                                       "1-2 nccl (a -> b), 2-3 copy-engine (b)")


def test_plan_pp2_dp2_one_pipeline_per_host() -> None:
    """rank = replica * pp + stage: each replica's pipeline on its own host, so no edge crosses."""
    edges = E.plan_edges(_facts(2, 2, ["a", "a", "b", "b"]), "auto", "cuda")
    assert _kinds(edges) == {(0, 1): "copy-engine", (2, 3): "copy-engine"}


@pytest.mark.parametrize("what,kwargs,choice,device", [
    ("--p2p nccl", {}, "nccl", "cuda"),
    ("no peer access", {"peer_access": False}, "auto", "cuda"),
    ("a rank without the copy engine", {"usable": False}, "auto", "cuda"),
    ("the CPU", {}, "auto", "cpu"),
    ("the CPU, copy engine asked", {}, "copy-engine", "cpu"),
])
def test_plan_collective_everywhere(what: str, kwargs: dict, choice: str, device: str) -> None:
    edges = E.plan_edges(_facts(4, 1, ["a", "a", "b", "b"], **kwargs), choice, device)
    want = "gloo" if device == "cpu" else "nccl"
    assert set(_kinds(edges).values()) == {want}, what


def test_one_rank_without_copy_engine_turns_it_off_everywhere() -> None:
    facts = _facts(4, 1, ["a"] * 4)
    facts[3] = E.RankFacts(3, "a", 2, None, 3, (0, 1, 2), False)
    assert set(_kinds(E.plan_edges(facts, "auto", "cuda")).values()) == {"nccl"}


def test_same_gpu_is_no_copy_engine_edge() -> None:
    facts = [E.RankFacts(0, "a", None, 1, 0, (1,), True), E.RankFacts(1, "a", 0, None, 0, (1,), True)]
    assert _kinds(E.plan_edges(facts, "auto", "cuda")) == {(0, 1): "nccl"}


def test_copy_engine_across_hosts_is_refused() -> None:
    with pytest.raises(ConfigError, match="ranks 1 and 2 run on different hosts .a, b.*--p2p auto"):
        E.plan_edges(_facts(4, 1, ["a", "a", "b", "b"]), "copy-engine", "cuda")
    assert set(_kinds(E.plan_edges(_facts(2, 1, ["a", "a"]), "copy-engine", "cuda")).values()) == {"copy-engine"}


def test_describe_counts_the_rest() -> None:
    edges = E.plan_edges(_facts(2, 12, [f"h{r // 2}" for r in range(24)]), "auto", "cpu")
    line = E.describe_edges(edges)
    assert line.startswith("p2p edges over 12 host(s), 0 across hosts: 0-1 gloo (h0), ") and "and 4 more" in line
    assert E.describe_edges([]) == "p2p edges: none (one stage per pipeline)"


def test_single_process_gets_the_collective_transport() -> None:
    transport, edges = make_edge_transport("auto", Links(None, None, None, None), torch.device("cpu"), 2)
    assert isinstance(transport, CollectiveTransport) and edges == []
    assert transport.name == "gloo"


class _Fake(Transport):
    """Records its calls into a shared log; receives return a tensor naming the transport and message."""

    def __init__(self, name: str, capacity: int | None, log: list) -> None:
        self.name, self.capacity, self.log = name, capacity, log

    def exchange(self, sends, recvs):
        self.log.append((self.name, [(k, mb) for k, mb, _ in sends], list(recvs)))
        return [torch.tensor([hash((self.name, k, mb)) % 1000]) for k, mb in recvs]

    def release(self, kind, mb):
        self.log.append((self.name, "release", kind, mb))

    def close(self):
        self.log.append((self.name, "close"))


def test_routed_exchange_order_and_results() -> None:
    """Middle rank 1: copy engine to rank 0, NCCL to rank 2. Buffered sends first, then the rendezvous batch,
    then the buffered receives; every result comes back in the order asked for."""
    log: list = []
    ce, nccl = _Fake("copy-engine", 4, log), _Fake("nccl", None, log)
    links = Links(prev_rank=0, next_rank=2, act_in=None, grad_in=None)
    routed = RoutedTransport(links, {0: ce, 2: nccl}, [ce, nccl])
    assert routed.name == "copy-engine+nccl" and routed.capacity is None
    assert routed.describe() == "copy-engine+nccl (0: copy-engine, 2: nccl)"
    t = torch.zeros(1)
    recvs = [(GRAD, 0), (ACT, 1), (GRAD, 2)]  # from 2 (nccl), from 0 (ce), from 2 (nccl)
    out = routed.exchange([(ACT, 0, t), (GRAD, 3, t)], recvs)  # to 2 (nccl), to 0 (ce)
    assert log == [("copy-engine", [(GRAD, 3)], []), ("nccl", [(ACT, 0)], [(GRAD, 0), (GRAD, 2)]),
                   ("copy-engine", [], [(ACT, 1)])]
    names = ["nccl", "copy-engine", "nccl"]
    assert [int(x) for x in out] == [hash((n, k, mb)) % 1000 for n, (k, mb) in zip(names, recvs)]
    log.clear()
    routed.release(ACT, 1)
    routed.release(GRAD, 0)
    routed.close()
    assert log == [("copy-engine", "release", ACT, 1), ("nccl", "release", GRAD, 0), ("copy-engine", "close"),
                   ("nccl", "close")]


def test_routed_capacity_without_rendezvous() -> None:
    log: list = []
    a, b, idle = _Fake("x", 4, log), _Fake("y", 2, log), _Fake("z", None, log)
    routed = RoutedTransport(Links(0, 2, None, None), {0: a, 2: b}, [idle, a, b])
    assert routed.capacity == 2 and routed.name == "x+y"  # a part without edges does not count
