"""The pre-packed flag-operation batches of distributed/p2p/flag_ops.py on the CPU: the C layout of each operation
(cuda.h's CUstreamBatchMemOpParams: 48 bytes, address at 8, value at 16, flags at 24), one packing per distinct
batch, the driver call's arguments, and the set-up probe that keeps the packed path only where a packed write reads
back. The driver is a stand-in that applies the packed operations to a dict of words; the GPU transport tests run
the real one."""

from __future__ import annotations

import ctypes
import struct
import types

import pytest

from peerline.distributed.p2p import flag_ops


def test_layout_is_the_union_of_cuda_h():
    p = flag_ops.BatchMemOpParams
    assert ctypes.sizeof(p) == 48
    assert (p.operation.offset, p.address.offset, p.value.offset, p.flags.offset, p.alias.offset) == (0, 8, 16, 24, 32)


def test_pack_ops_encodes_each_operation():
    ops = (("wait", 0x7F00_0000_1000, 3), ("write", 0x7F00_0000_2004, 0xFFFF_FFFF))
    array = flag_ops.pack_ops(ops)
    raw = ctypes.string_at(ctypes.addressof(array), 96)
    fields = [struct.unpack_from("<IIQQIIQQ", raw, 48 * i) for i in range(2)]
    assert fields[0][:5:] == (flag_ops.OP_WAIT_32, 0, 0x7F00_0000_1000, 3, 1)  # CU_STREAM_WAIT_VALUE_EQ
    assert fields[1][:5:] == (flag_ops.OP_WRITE_32, 0, 0x7F00_0000_2004, 0xFFFF_FFFF, 0)  # fenced write
    with pytest.raises(ValueError, match="unknown flag operation"):
        flag_ops.pack_ops((("read", 0, 0),))


class Device:
    """A stand-in driver: 32-bit words by address; packed batches decoded from their C array and applied."""

    def __init__(self, corrupt: bool = False, fail: int = 0) -> None:
        self.words: dict[int, int] = {}
        self.calls: list[tuple[int, int, int, int]] = []
        self.corrupt, self.fail = corrupt, fail

    def packed(self, stream: int, count: int, address: int, flags: int) -> int:
        self.calls.append((stream, count, address, flags))
        if self.fail:
            return self.fail
        array = (flag_ops.BatchMemOpParams * count).from_address(address)
        for op in array:
            if op.operation == flag_ops.OP_WRITE_32:
                self.words[op.address] = (op.value + self.corrupt) & 0xFFFF_FFFF
            else:
                assert op.operation == flag_ops.OP_WAIT_32 and self.words.get(op.address) == op.value
        return 0

    def bindings(self) -> types.SimpleNamespace:
        """What FlagOps reads of cuda.bindings.driver: single writes and waits, the handle types."""
        def write(stream, ptr, value, flags):
            self.words[ptr] = value
            return (0,)

        return types.SimpleNamespace(
            CUstreamWaitValue_flags=types.SimpleNamespace(CU_STREAM_WAIT_VALUE_EQ=types.SimpleNamespace(value=1)),
            CUstream=lambda handle: handle, CUdeviceptr=lambda addr: addr, cuStreamWriteValue32=write,
            cuStreamWaitValue32=lambda *a: (0,))


def make_ops(monkeypatch: pytest.MonkeyPatch, device: Device) -> flag_ops.FlagOps:
    monkeypatch.setattr(flag_ops, "_cu", device.bindings())
    monkeypatch.setattr(flag_ops, "_libcuda_batch", lambda: device.packed)
    return flag_ops.FlagOps()


def test_a_batch_is_packed_once_and_issued_by_its_address(monkeypatch):
    device = Device()
    ops = make_ops(monkeypatch, device)
    batch = (("write", 64, 5), ("wait", 64, 5), ("write", 68, 9))
    ops.batch(7, batch)
    ops.batch(7, batch)
    assert [c[:2] for c in device.calls] == [(7, 3), (7, 3)] and device.calls[0][3] == 0
    assert device.calls[0][2] == device.calls[1][2]  # the same packed array, not packed again
    assert device.words == {64: 5, 68: 9}
    ops.batch(7, (("write", 72, 1),))  # a single operation: one plain call, no batch
    assert len(device.calls) == 2 and device.words[72] == 1
    ops.forget()
    ops.batch(7, batch)
    assert len(device.calls) == 3


@pytest.mark.parametrize("device,keeps", [(Device(), True), (Device(corrupt=True), False), (Device(fail=1), False)])
def test_the_probe_keeps_the_packed_path_only_where_a_packed_write_reads_back(monkeypatch, caplog, device, keeps):
    ops = make_ops(monkeypatch, device)
    device.words[128] = 0
    synced = []
    assert ops.probe_packed(3, 128, 0, read=lambda: device.words[128], sync=lambda: synced.append(1)) is keeps
    assert device.words[128] == 0  # the word holds its value again, whatever the probe saw
    assert (ops.packed_call is not None) is keeps and synced  # the restoring write is waited for
    assert ("pre-packed cuStreamBatchMemOp unusable" in caplog.text) is not keeps
    if not keeps:  # batches now go through cuda-bindings' list form
        monkeypatch.setattr(flag_ops._cu, "cuStreamBatchMemOp", lambda *a: (0,), raising=False)
        monkeypatch.setattr(flag_ops._cu, "CUstreamBatchMemOpParams", lambda: types.SimpleNamespace(
            waitValue=types.SimpleNamespace(), writeValue=types.SimpleNamespace()), raising=False)
        monkeypatch.setattr(flag_ops._cu, "CUstreamBatchMemOpType", types.SimpleNamespace(
            CU_STREAM_MEM_OP_WAIT_VALUE_32=1, CU_STREAM_MEM_OP_WRITE_VALUE_32=2), raising=False)
        calls = len(device.calls)
        ops.batch(3, (("write", 128, 1), ("write", 132, 2)))
        assert len(device.calls) == calls


def test_a_thread_without_a_context_adopts_the_streams_and_retries(monkeypatch):
    """CUDA_ERROR_INVALID_CONTEXT (a thread that never touched the driver): the stream's context is made current
    and the batch issued again, once."""
    device = Device()
    ops = make_ops(monkeypatch, device)
    answers = [flag_ops.INVALID_CONTEXT]
    real = device.packed
    ops.packed_call = lambda *a: answers.pop() if answers else real(*a)
    adopted = []
    monkeypatch.setattr(flag_ops, "adopt_stream_context", lambda stream: adopted.append(stream) or True)
    ops.batch(9, (("write", 16, 4), ("write", 20, 5)))
    assert adopted == [9] and device.words == {16: 4, 20: 5}
    answers.append(7)  # any other error: raised
    with pytest.raises(RuntimeError, match="CUresult 7"):
        ops.batch(9, (("write", 16, 4), ("write", 20, 5)))
