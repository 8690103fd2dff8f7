"""Copy-engine transport: activations and gradients written straight into the neighbour's memory over CUDA IPC.

Per pipeline edge and direction the receiver owns a ring of `depth` slots (cudaMalloc, exported by IPC handle and
opened once by the sender) and the flag words of handoff_protocol.py. The sender's p2p stream waits until
the slot is free, takes it, copies with the copy engine (no SM time) and sets FULL in the receiver's memory; the
receiver's compute stream waits for FULL, clears it, uses the slot in place (no second copy) and, on
`release(kind, mb)`, sets FREE in the sender's memory. All waits poll local memory; all values are the constants
0/1, so a captured CUDA graph replays the same handoffs correctly every time. Nothing waits on the host.

Construction is collective over `group` (every rank of it builds its transport): handles are exchanged with one
`all_gather_object`. `close()` is collective too: a rank frees its memory only after every peer unmapped it.

Order of work, per rank:
  exchange(sends, recvs)  p2p stream waits for the current stream (the producer), then per send: wait FREE, clear
                          FREE, copy, write the peer's FULL. Receives go on the current stream: wait FULL, clear it.
                          The sent tensor is kept alive for the copy with record_stream(p2p). Consecutive flag
                          operations go to the driver as one cuStreamBatchMemOp (wait FREE + clear FREE is one
                          call, one batch-memop node under capture). Lanes, see below.
  release(kind, mb)       current stream writes FREE = 1 into the sender's memory.
  join() / finish_iteration()
                          current stream waits for every copy issued so far. Needed once per iteration before a
                          CUDA-graph capture ends (captured p2p work must rejoin the capturing stream); harmless
                          in eager iterations (the engine calls it before the optimizer step).

Contract with the caller: a received tensor is a view of the slot, valid until `release` (the engine releases
after the microbatch's backward, which is what `capacity = depth` tells the schedule validator); release orders
after the current stream only, so nothing on another stream may still read the slot; messages of one kind whose
microbatches share a slot (mb % depth) are received and released in send order. Do not send a received slot view
itself onward (its release could free the slot before the outgoing copy read it). Keep
CUDA_DEVICE_MAX_CONNECTIONS at 8 or more (streams.py asks for 32): a stream waiting on a flag must not block
unrelated streams.

Lanes (send streams: `streams.p2p` plus `lanes`), grouped by `split`:
  split=False  groups of one lane; slot s goes on group s % groups (round robin): the flag operations of one
               message overlap the copy of the next on another lane.
  split=True   groups of two lanes; every message (>= SPLIT_MIN_BYTES) is cut in two halves copied at once by the
               group's two lanes (two copy engines on one message). The group's first lane does the flag
               operations: wait FREE + clear FREE, then the second lane joins it by event (so it copies only into
               a free slot), both copy their half, the first lane waits for the second by event, then writes FULL
               (so FULL means both halves landed). Groups (lanes // 2 of them) take slots round robin.
  decoupled=True
               the flag operations leave the copy streams: with lanes [c0, .., ck, F, W] the copy lanes c0..ck take
               slots round robin and do nothing but copies (back to back, like raw cudaMemcpyPeerAsync: flag
               operations between the copies of one stream slow the copies down, and two copy engines on one message
               need not be faster than one; docs/benchmarks/code-notes.md). F does wait FREE + clear FREE and records
               the slot's event E_free; the copy lane waits E_free (long satisfied in steady state), copies, records
               E_copied; W waits E_copied and writes FULL. The copy lane follows the producer through E_free (F waits
               for the current stream). FREE and FULL need two streams: on one, the wait for message m's copy would
               hold back message m+1's FREE wait, and so m+1's copy. Each of the three streams keeps the message order
               of a single lane and waits only for what that lane would, so decoupled never blocks where one lane
               would not. Events: one E_free and one E_copied per (kind, slot), made at set-up (capture-safe: under
               capture they become graph edges); reusing a slot's event is safe because a wait binds to the record
               issued before it.
In every variant one slot's sends stay on one group, so a slot's uses keep their order, and the protocol of
handoff_protocol.py is unchanged (one FREE and one FULL word per slot).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from peerline import overrides
from peerline.distributed.p2p import flag_ops, ipc
from peerline.distributed.p2p import handoff_protocol as handoff
from peerline.distributed.p2p.base import ACT, GRAD, Links, TensorSpec, Transport
from peerline.distributed.streams import RankStreams, create_rank_streams
from peerline.kernels.capture_state import capturing

log = logging.getLogger(__name__)

KINDS = (ACT, GRAD)
FLAG_STRIDE = 64  # bytes between flag words: one word per 64-byte sector, no two flags share a line
SLOT_ALIGN = 4096  # slot start alignment: every dtype view is aligned and copies start on page boundaries
# Smaller split messages go whole (two events would cost more than half a copy saves); tests lower it through the
# environment to split the small messages of the pipeline checks.
SPLIT_MIN_BYTES = overrides.get_int("PEERLINE_P2P_SPLIT_MIN", 1 << 20)
SPLIT_ALIGN = 256  # the halves of a split message start on 256-byte boundaries
POISON = 0xFF  # initial slot bytes (NaN in bf16/fp16/fp32): a read before the first copy shows up in checksums


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def flag_offset(kind: str, flag: str, slot: int, depth: int) -> int:
    """Byte offset of a flag word in its owner's flag allocation. Every rank uses the same layout, so a peer
    finds our words from the base address alone: FULL words of the kinds we receive, FREE words of those we send."""
    region = KINDS.index(kind) * 2 + (0 if flag == handoff.FULL else 1)
    return (region * depth + slot) * FLAG_STRIDE


@dataclass(frozen=True)  # no slots: frozen slotted dataclasses do not unpickle on Python 3.10
class _Ring:
    """What a receiver tells its sender about one ring."""

    kind: str
    sender: int
    handle: bytes
    slot_stride: int
    slot_bytes: int
    dtype: str
    shape: tuple[int, ...]


def _single_node() -> bool:
    """Whether every rank of the job runs on this host, from launcher variables every rank shares."""
    env = overrides.environment()
    pairs = (("LOCAL_WORLD_SIZE", "WORLD_SIZE"),  # torchrun
             ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
             ("MPI_LOCALNRANKS", "PMI_SIZE"))  # MPICH / Hydra
    for local, world in pairs:
        if local in env and world in env:
            return env[local] == env[world]
    for nodes in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if nodes in env:
            return env[nodes] == "1"
    return env.get("WORLD_SIZE", "1") == "1"


def copy_engine_usable(links: Links, device: torch.device) -> bool:
    """Whether the copy-engine transport can serve this job. Not collective, and the same answer on every rank:
    it depends only on facts all ranks share (all ranks on one host, every pair of the job's GPUs with peer
    access, CuPy and cuda-bindings importable), because every rank must pick the same transport."""
    if device.type != "cuda" or not (ipc.available() and flag_ops.available()):
        return False
    if not _single_node():
        return False
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        overrides.get_int("WORLD_SIZE", 1)
    # world > visible GPUs: one GPU per process, hidden from the others, so no peer copy into IPC memory
    if world < 2 or world > torch.cuda.device_count():
        return False
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(world) for j in range(world) if i != j)


class CopyEngineTransport(Transport):
    """One rank's ends of its pipeline edges over CUDA IPC and the copy engine (see the module docstring).

    depth: ring slots per edge and direction (the schedule's in-flight microbatches must fit; default
    num_microbatches, enough for GPipe). capture_safe: issue copies with cudaMemcpyAsync(cudaMemcpyDefault),
    which a CUDA graph can capture, instead of cudaMemcpyPeerAsync (copies issued under capture always use it).
    group: process group for the handle exchange and the closing barriers (default: the world).
    lanes: extra streams (made by distributed/streams.py) that carry sends beside `streams.p2p`; default
    `streams.p2p_lanes` (the extra lanes RankStreams was created with). split: cut each message in two halves
    copied by two lanes at once (needs an even number of lanes in all). See the module docstring.
    batch_flags: send consecutive flag operations as one cuStreamBatchMemOp (False: one driver call per
    operation; also PEERLINE_P2P_BATCH=0 in the environment). decoupled: the last two lanes carry the FREE and the
    FULL flag operations, the others only copies (needs >= 3 lanes, not with split).
    """

    name = "copy-engine"
    _fork_event: torch.cuda.Event | None = None  # made at the first fork (_order), then reused

    def __init__(self, links: Links, device: torch.device, num_microbatches: int,
                 streams: RankStreams | None = None, *, depth: int | None = None, capture_safe: bool = False,
                 group: dist.ProcessGroup | None = None, lanes: list[torch.cuda.Stream] | None = None,
                 split: bool = False, batch_flags: bool = True, decoupled: bool = False) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"copy-engine transport needs a CUDA device with an index, got {device}")
        depth = num_microbatches if depth is None else depth
        if depth < 1:
            raise ValueError(f"copy-engine ring depth must be >= 1, got {depth}")
        flag_ops.check_connections()
        self.links, self.device, self.depth, self.group = links, device, depth, group
        self.capacity = depth
        self.capture_safe = capture_safe
        self.rank = dist.get_rank()
        self.streams = streams if streams is not None else create_rank_streams(device)
        self.p2p: torch.cuda.Stream = self.streams.p2p
        self.split, self.decoupled = split, decoupled
        self._assign_lanes(lanes)
        self._events: dict[tuple[str, int], tuple[torch.cuda.Event, torch.cuda.Event]] = {}  # E_free, E_copied
        self._ops = flag_ops.FlagOps()
        self._ops.batching = batch_flags and overrides.get("PEERLINE_P2P_BATCH") != "0"
        self._held: dict[tuple[str, int], int] = {}  # (kind, slot) -> mb received and not yet released
        self._pending: list[torch.cuda.Stream] = []  # lanes with sends issued since the last join()
        self._closed = False
        self._rings: dict[str, ipc.DeviceAllocation] = {}
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._maps: dict[tuple[int, str], ipc.PeerMapping] = {}  # (peer rank, "flags" | kind) -> mapping
        with torch.cuda.device(device):
            self._allocate()
            infos = self._gather()
            self._validate(infos)
            self._connect(infos)
        log.info("rank %d: %s", self.rank, self.describe())

    # --- set-up ---------------------------------------------------------------------------------------------
    def _assign_lanes(self, lanes: list[torch.cuda.Stream] | None) -> None:
        """Sort the send streams into groups of copy lanes (pairs when split) and, when decoupled, the FREE and
        FULL flag streams (module docstring, "Lanes")."""
        extra = lanes if lanes is not None else list(getattr(self.streams, "p2p_lanes", []) or [])
        self._lanes: list[torch.cuda.Stream] = [self.p2p, *extra]
        width = 2 if self.split else 1
        if len(self._lanes) % width:
            raise ValueError(f"split copies need an even number of p2p lanes, got {len(self._lanes)}")
        copy_lanes = self._lanes
        if self.decoupled:
            if self.split or len(self._lanes) < 3:
                raise ValueError("decoupled flags need >= 3 p2p lanes (copy lanes, then a FREE and a FULL flag "
                                 f"stream) and no split, got {len(self._lanes)} lane(s)"
                                 f"{', split' if self.split else ''}")
            *copy_lanes, self._free_lane, self._full_lane = self._lanes
        self._groups = [copy_lanes[i:i + width] for i in range(0, len(copy_lanes), width)]

    def _allocate(self) -> None:
        """Receive rings for the kinds this rank receives, and its flag words, initialised on the p2p stream."""
        for kind, spec in ((ACT, self.links.act_in), (GRAD, self.links.grad_in)):
            if spec is None or self.links.peer_or_none(kind) is None:
                continue
            stride = _round_up(max(spec.nbytes, 1), SLOT_ALIGN)
            ring = self._rings[kind] = ipc.DeviceAllocation(stride * self.depth, self.device)
            for slot in range(self.depth):
                self._views[(kind, slot)] = ipc.view_as(ring.tensor, slot * stride, spec.shape, spec.dtype)
        self._flags = ipc.DeviceAllocation(len(KINDS) * 2 * self.depth * FLAG_STRIDE, self.device)
        with torch.cuda.stream(self.p2p):
            self._flags.tensor.view(torch.int32).copy_(self._initial_flags())
            for ring in self._rings.values():
                ring.tensor.fill_(POISON)
        if self.decoupled:  # torch creates an event at its first record: do that here, never in the send path
            for kind in KINDS:
                for slot in range(self.depth):
                    pair = self._events[(kind, slot)] = (torch.cuda.Event(), torch.cuda.Event())
                    for ev in pair:
                        ev.record(self.p2p)
        # Host sync at set-up only: peers may write our flags as soon as the exchange below returns.
        self.p2p.synchronize()
        if self._ops.batching:  # rewrite one FULL word (0, nobody writes it yet): does the driver take batches?
            offset = flag_offset(ACT, handoff.FULL, 0, self.depth)
            word, initial = self._flags.ptr + offset, handoff.INITIAL[handoff.FULL]
            self._ops.probe_batch(self.p2p.cuda_stream, word, initial)
            self.p2p.synchronize()
            # the pre-packed batches: a packed write of that word must read back (flag_ops.FlagOps.probe_packed)
            self._ops.probe_packed(self.p2p.cuda_stream, word, initial, sync=self.p2p.synchronize,
                                   read=lambda: self._read_flag(offset))

    def _read_flag(self, offset: int) -> int:
        """The flag word at byte `offset` of this rank's flags, read on the p2p stream (a host sync: set-up only)."""
        with torch.cuda.stream(self.p2p):
            return int(self._flags.tensor.view(torch.int32)[offset // 4].item())

    def _ring_info(self, kind: str) -> _Ring:
        spec: TensorSpec = self.links.act_in if kind == ACT else self.links.grad_in
        ring = self._rings[kind]
        return _Ring(kind, self.links.peer_or_none(kind), ring.handle(), ring.nbytes // self.depth, spec.nbytes,
                     str(spec.dtype), tuple(spec.shape))

    def _gather(self) -> list[dict]:
        mine = {"rank": self.rank, "host": socket.gethostname(), "uuid": ipc.device_uuid(self.device.index),
                "visible": [ipc.device_uuid(i) for i in range(torch.cuda.device_count())],
                "depth": self.depth, "prev": self.links.prev_rank, "next": self.links.next_rank,
                "flags": self._flags.handle(), "rings": {k: self._ring_info(k) for k in self._rings}}
        infos: list[dict | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(infos, mine, group=self.group)
        return infos  # type: ignore[return-value]

    def _validate(self, infos: list[dict]) -> None:
        """Check every edge of the job on every rank, so all ranks raise the same error together (none is left
        waiting in a later collective)."""
        by_rank = {info["rank"]: info for info in infos}
        problems = []
        depths = {info["depth"] for info in infos}
        if len(depths) > 1:
            problems.append(f"ranks disagree on the ring depth: {sorted(depths)}")
        for info in infos:
            for peer in (info["prev"], info["next"]):
                if peer is None:
                    continue
                other = by_rank.get(peer)
                if other is None:
                    problems.append(f"rank {info['rank']}'s neighbour {peer} is not in the process group")
                elif other["host"] != info["host"]:
                    problems.append(f"ranks {info['rank']} and {peer} run on different hosts "
                                    f"({info['host']}, {other['host']}): use --p2p nccl")
                elif other["uuid"] not in info["visible"]:
                    problems.append(f"rank {info['rank']} cannot see the GPU of rank {peer} "
                                    "(CUDA_VISIBLE_DEVICES hides it): use --p2p nccl")
        if problems:
            raise RuntimeError("copy-engine transport: " + "; ".join(problems))

    def _open(self, peer: int, what: str, handle: bytes) -> int:
        key = (peer, what)
        if key not in self._maps:
            self._maps[key] = ipc.PeerMapping(handle, self.device)
        return self._maps[key].ptr

    def _connect(self, infos: list[dict]) -> None:
        """Open the peers' rings and flags and turn the protocol's op lists into addresses."""
        by_rank = {info["rank"]: info for info in infos}
        local = self._flags.ptr
        self._send_prog: dict[tuple[str, int], list[tuple[str, object]]] = {}
        self._recv_prog: dict[tuple[str, int], list[tuple[str, object]]] = {}
        self._release_prog: dict[tuple[str, int], list[tuple[str, object]]] = {}
        self._send_to: dict[str, tuple[int, int, _Ring]] = {}  # kind -> (peer rank, peer device ordinal, ring)
        for kind in KINDS:
            peer = self.links.next_rank if kind == ACT else self.links.prev_rank
            ring = by_rank[peer]["rings"].get(kind) if peer is not None else None
            if ring is None or ring.sender != self.rank:
                continue
            base = self._open(peer, kind, ring.handle)
            peer_flags = self._open(peer, "flags", by_rank[peer]["flags"])
            self._send_to[kind] = (peer, ipc.find_device(by_rank[peer]["uuid"]), ring)
            for slot in range(self.depth):
                self._send_prog[(kind, slot)] = self._resolve(handoff.send_ops(slot), kind, local, peer_flags,
                                                              base + slot * ring.slot_stride)
        for kind in self._rings:
            src = self.links.peer_or_none(kind)
            peer_flags = self._open(src, "flags", by_rank[src]["flags"])
            for slot in range(self.depth):
                self._recv_prog[(kind, slot)] = self._resolve(handoff.recv_ops(slot), kind, local, peer_flags, 0)
                self._release_prog[(kind, slot)] = self._resolve(handoff.release_ops(slot), kind, local,
                                                                 peer_flags, 0)

    def _resolve(self, ops: tuple[handoff.Op, ...], kind: str, local: int, peer: int, dst: int
                 ) -> list[tuple[str, object]]:
        """Turn an op list into segments: ("flags", ((action, addr, value), ...)) for each run of consecutive flag
        operations (issued as one batch) and ("copy", dst) for the copy."""
        prog: list[tuple[str, object]] = []
        run: list[tuple[str, int, int]] = []
        for op in ops:
            if op.action == "copy":
                if run:
                    prog.append(("flags", tuple(run)))
                    run = []
                prog.append(("copy", dst))
            else:
                base = local if op.where == handoff.LOCAL else peer
                run.append((op.action, base + flag_offset(kind, op.flag, op.slot, self.depth), op.value))
        if run:
            prog.append(("flags", tuple(run)))
        return prog

    # --- hot path -------------------------------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether `t` lives on this rank's GPU (the CPU simulation in tests/unit replaces this)."""
        return t.device == self.device

    def _check_send(self, kind: str, mb: int, t: torch.Tensor) -> tuple[int, int, _Ring]:
        if kind not in self._send_to:
            raise ValueError(f"rank {self.rank} has no copy-engine edge to send {kind!r} (mb {mb})")
        target = self._send_to[kind]
        ring = target[2]
        if not self._on_device(t) or str(t.dtype) != ring.dtype or t.nbytes != ring.slot_bytes:
            raise ValueError(f"send {kind} mb {mb}: got {tuple(t.shape)} {t.dtype} on {t.device}, the receiver "
                             f"expects {ring.shape} {ring.dtype} on {self.device}")
        return target

    def exchange(self, sends: list[tuple[str, int, torch.Tensor]], recvs: list[tuple[str, int]]
                 ) -> list[torch.Tensor]:
        cur = torch.cuda.current_stream(self.device)
        # Validate the whole group on the host before queuing anything: a bad call must not leave half a group
        # on the GPU (a receive nobody sends would hang the stream).
        keys = self._recv_keys(recvs)
        staged = []
        for kind, mb, t in sends:
            if t.requires_grad:  # (what the engine sends never does: no alias made per message)
                t = t.detach()
            t = t.contiguous()  # on the current stream, before the p2p stream waits for it
            staged.append((kind, mb, t, self._check_send(kind, mb, t)))
        if staged and self.decoupled:
            self._send_decoupled(cur, staged)
        elif staged:
            self._send_on_lanes(cur, staged)
        return self._receive(cur, recvs, keys)

    def _recv_keys(self, recvs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The (kind, slot) of each receive, checked: an edge exists and the slot is not still held."""
        keys: list[tuple[str, int]] = []
        for kind, mb in recvs:
            key = (kind, handoff.slot_of(mb, self.depth))
            if key not in self._recv_prog:
                raise ValueError(f"rank {self.rank} has no copy-engine edge to receive {kind!r} (mb {mb})")
            if key in self._held or key in keys:
                holder = self._held.get(key, "another receive of this group")
                raise RuntimeError(f"receive {kind} mb {mb}: its slot {key[1]} still holds mb {holder}; release "
                                   f"that first or use a deeper ring (depth {self.depth})")
            keys.append(key)
        return keys

    def _send_on_lanes(self, cur: torch.cuda.Stream, staged: list) -> None:
        """Sends with the flag operations on the copy lanes (module docstring, split=False / split=True)."""
        capture = self.capture_safe or capturing()
        waited: list[torch.cuda.Stream] = []
        for kind, mb, t, (_peer, peer_dev, ring) in staged:
            slot = handoff.slot_of(mb, self.depth)
            group = self._groups[slot % len(self._groups)]
            head = group[0]
            if head not in waited:
                self._order(head, cur)  # "activation produced"
                waited.append(head)
            parts = self._parts(ring.slot_bytes) if len(group) > 1 else [(0, ring.slot_bytes)]
            used = group[:len(parts)]
            for lane in used:
                if lane not in self._pending:
                    self._pending.append(lane)
            for seg, arg in self._send_prog[(kind, slot)]:
                if seg == "flags":
                    self._ops.batch(head.cuda_stream, arg)
                    continue
                for lane in used[1:]:
                    self._order(lane, head)  # the slot is free (and the producer done): the other part may copy
                for lane, (off, n) in zip(used, parts):
                    ipc.copy_peer(arg + off, peer_dev, t.data_ptr() + off, self.device.index, n,
                                  lane.cuda_stream, capture)
                for lane in used[1:]:
                    self._order(head, lane)  # FULL only once every part landed
            if t.is_cuda:  # (the CPU simulation in tests/unit passes host tensors)
                for lane in used:
                    t.record_stream(lane)  # the caller may drop t; its memory is reused only after the copy

    def _receive(self, cur: torch.cuda.Stream, recvs: list[tuple[str, int]], keys: list[tuple[str, int]]
                 ) -> list[torch.Tensor]:
        """Queue each receive on the current stream (wait FULL + clear FULL) and return the slot views."""
        out = []
        c = cur.cuda_stream
        for (_kind, mb), key in zip(recvs, keys):
            for _seg, ops in self._recv_prog[key]:
                self._ops.batch(c, ops)  # wait FULL + clear FULL: one call
            self._held[key] = mb
            out.append(self._views[key].detach())  # a fresh alias: callers may set requires_grad on it
        return out

    def _send_decoupled(self, cur: torch.cuda.Stream, staged: list) -> None:
        """Sends with the flag operations on their own streams (module docstring, decoupled=True)."""
        capture = self.capture_safe or capturing()
        free, full = self._free_lane, self._full_lane
        # Only the FREE stream waits for the producer (and so joins a capture): the copy lanes follow it through
        # E_free, which keeps one more wait off the copy streams.
        self._order(free, cur)
        for kind, mb, t, (_peer, peer_dev, ring) in staged:
            slot = handoff.slot_of(mb, self.depth)
            lane = self._groups[slot % len(self._groups)][0]
            e_free, e_copied = self._events[(kind, slot)]
            for s in (free, lane, full):
                if s not in self._pending:
                    self._pending.append(s)  # join() rejoins all three (a capture must join every fork)
            flags_on = free
            for seg, arg in self._send_prog[(kind, slot)]:
                if seg == "flags":  # before the copy: wait FREE + clear FREE; after it: write the peer's FULL
                    self._ops.batch(flags_on.cuda_stream, arg)
                    continue
                e_free.record(free)
                lane.wait_event(e_free)  # never copy into a slot the receiver still reads
                ipc.copy_peer(arg, peer_dev, t.data_ptr(), self.device.index, ring.slot_bytes, lane.cuda_stream,
                              capture)
                e_copied.record(lane)
                full.wait_event(e_copied)  # FULL only once the copy landed
                flags_on = full
            if t.is_cuda:  # (the CPU simulation in tests/unit passes host tensors)
                t.record_stream(lane)  # only the copy lane reads t

    def _order(self, waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
        """`waiter.wait_stream(producer)` through one event reused for every such fork: torch's wait_stream makes a
        new event per call (created at its record, destroyed when collected), a few host microseconds per message.
        Reuse is safe because a wait binds to the record issued just before it, here and under capture."""
        event = self._fork_event
        if event is None:
            event = self._fork_event = torch.cuda.Event()
        event.record(producer)
        waiter.wait_event(event)

    def release(self, kind: str, mb: int) -> None:
        key = (kind, handoff.slot_of(mb, self.depth))
        if self._held.get(key) != mb:
            raise ValueError(f"release {kind} mb {mb}: not received (slot holds {self._held.get(key)})")
        c = torch.cuda.current_stream(self.device).cuda_stream
        for _seg, ops in self._release_prog[key]:
            self._ops.batch(c, ops)
        del self._held[key]

    def _parts(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, bytes) of the parts a split message is copied in: two halves cut at a SPLIT_ALIGN boundary, or
        the whole message when it is small."""
        if nbytes < SPLIT_MIN_BYTES:
            return [(0, nbytes)]
        half = nbytes // 2 // SPLIT_ALIGN * SPLIT_ALIGN
        return [(0, half), (half, nbytes - half)] if half else [(0, nbytes)]

    def join(self) -> None:
        """Make the current stream wait for every copy issued so far (before a graph capture ends)."""
        pending, self._pending = self._pending, []
        cur = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        for lane in pending:
            if capturing:
                with torch.cuda.stream(lane):
                    if not torch.cuda.is_current_stream_capturing():
                        continue  # sends issued before this capture began: eager work, not part of the graph
            cur.wait_stream(lane)

    def finish_iteration(self) -> None:
        """Transport hook at the end of an iteration: join the p2p stream into the current stream."""
        self.join()

    # --- inspection and shutdown ----------------------------------------------------------------------------
    def flag_state(self) -> dict[str, list[int]]:
        """This rank's flag words per (kind, flag) name, read back (synchronizes: tests and close only)."""
        words = self._flags.tensor.view(torch.int32).cpu()
        return {f"{kind}.{flag}": [int(words[flag_offset(kind, flag, s, self.depth) // 4]) for s in
                                   range(self.depth)] for kind in KINDS for flag in (handoff.FULL, handoff.FREE)}

    def idle(self) -> bool:
        """Whether every flag is back in its initial state (nothing in flight, everything released)."""
        return all(all(v == handoff.INITIAL[name.split(".")[1]] for v in values)
                   for name, values in self.flag_state().items())

    def reset(self, flags: bool = False) -> None:
        """Forget host bookkeeping (received-but-unreleased slots, unjoined lanes), e.g. after a CUDA-graph capture
        failed half-way: captured operations never ran, so the device flags are still consistent. flags=True
        (collective over `group`, synchronizes): also put every flag word back to its initial value, after an
        iteration that was abandoned with messages delivered but not released (a stream still blocked in a wait
        cannot be rescued this way: the synchronize would wait for it)."""
        self._held.clear()
        self._pending = []
        if not flags:
            return
        barrier = dist.is_available() and dist.is_initialized()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            if barrier:
                dist.barrier(group=self.group)  # no peer writes into our flags any more
            self._flags.tensor.view(torch.int32).copy_(self._initial_flags())
            torch.cuda.synchronize(self.device)
            if barrier:
                dist.barrier(group=self.group)  # nobody resumes before every rank reset

    def _initial_flags(self) -> torch.Tensor:
        init = torch.zeros(self._flags.nbytes // 4, dtype=torch.int32)
        for kind in KINDS:
            for slot in range(self.depth):
                for flag in (handoff.FULL, handoff.FREE):
                    init[flag_offset(kind, flag, slot, self.depth) // 4] = handoff.INITIAL[flag]
        return init

    def describe(self) -> str:
        edges = [f"{k}->{peer}" for k, (peer, _d, _r) in self._send_to.items()]
        edges += [f"{k}<-{self.links.peer_or_none(k)}" for k in self._rings]
        mode = "capture-safe copies" if self.capture_safe else "cudaMemcpyPeerAsync"
        lanes = f"{len(self._lanes)} lane(s){', split' if self.split else ''}"
        if self.decoupled:
            lanes += f", decoupled flags ({len(self._groups)} copy lane(s))"
        batch = "batched flag ops" if self._ops.batching else "single flag ops"
        return f"copy-engine ({', '.join(edges) or 'no edges'}; depth {self.depth}; {lanes}; {mode}; {batch})"

    def close(self) -> None:
        """Collective: wait for local work, check the flags, unmap the peers' memory, then free ours once every
        peer has unmapped it (freeing exported memory before the importer closes it is undefined)."""
        if self._closed:
            return
        self._closed = True
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            barrier = dist.is_available() and dist.is_initialized()
            if barrier:
                dist.barrier(group=self.group)  # after it, the peers' last writes into our flags have landed
            if self._held or not self.idle():
                log.warning("rank %d: copy-engine closed with messages in flight or unreleased (held %s, flags %s)",
                            self.rank, sorted(self._held), self.flag_state())
            for m in self._maps.values():
                m.close()
            if barrier:
                dist.barrier(group=self.group)
            self._views.clear()
            for ring in self._rings.values():
                ring.free()
            self._flags.free()
            self._ops.forget()
