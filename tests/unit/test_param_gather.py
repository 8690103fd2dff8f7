"""--overlap-param-gather's per-bucket waits (grad_sync/param_gather.py), with a fake sharded sync whose all-gathers
return work handles that log their wait: the all-gathers are issued in the order the forward reads the buckets, and
each bucket is waited for right before the first layer that reads it, once per iteration; the step's finish waits
for a bucket no forward read; the flag's configuration check."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerline.distributed.config import ConfigError, RunConfig
from peerline.distributed.grad_sync.buckets import plan_buckets, ready_order
from peerline.distributed.grad_sync.param_gather import ParamGather, first_readers, forward_order


class FakeWork:
    def __init__(self, log: list[tuple[str, int]], index: int) -> None:
        self.log, self.index = log, index

    def wait(self) -> None:
        self.log.append(("wait", self.index))


class FakeSync:
    """What ParamGather uses of ShardedGradBuckets, on the CPU: buckets, groups, gather_bucket, `overlap`."""

    def __init__(self, layers: list[nn.Module], log: list[tuple[str, int]]) -> None:
        self.buckets = plan_buckets(ready_order([list(m.parameters()) for m in layers]), 0.0001, 0.0001)
        self.bucket_groups = [None] * len(self.buckets)
        self.on_cuda, self.stream, self.device = False, None, torch.device("cpu")
        self.overlap = None
        self.log = log

    def gather_bucket(self, index: int, group: object, async_op: bool = False) -> FakeWork:
        assert async_op  # gloo: the forward waits for the Work
        self.log.append(("issue", index))
        return FakeWork(self.log, index)


class LoggedLinear(nn.Linear):
    """A layer whose forward call itself is logged (after every pre-hook)."""

    def __init__(self, index: int, log: list[tuple[str, int]]) -> None:
        super().__init__(8, 8)
        self.index, self.log = index, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("forward", self.index))
        return super().forward(x)


def _stage(log: list[tuple[str, int]]) -> tuple[nn.Sequential, FakeSync]:
    torch.manual_seed(0)
    model = nn.Sequential(*[LoggedLinear(i, log) for i in range(4)])  # 288 bytes each: buckets of 1 or 2 tensors
    return model, FakeSync(list(model), log)


def test_each_bucket_is_waited_for_right_before_its_first_reader():
    log: list[tuple[str, int]] = []
    model, sync = _stage(log)
    gather = ParamGather(sync, list(model))
    assert sync.overlap is gather
    readers = first_readers(sync.buckets, list(model))
    assert len(sync.buckets) >= 3 and readers[0] == 3 and readers[-1] == 0  # backward filled the last layer first
    gather.start()
    issued = [i for what, i in log if what == "issue"]
    assert issued == forward_order(readers) and readers == sorted(readers, reverse=True)
    log.clear()
    for _ in range(2):  # two microbatches: the second waits for nothing
        model(torch.randn(2, 8))
    expected: list[tuple[str, int]] = []
    for layer in range(4):
        # the buckets whose first reader is this layer, waited for after the previous layer ran, before this one
        expected += [("wait", i) for i in forward_order(readers) if readers[i] == layer]
        expected.append(("forward", layer))
    expected += [("forward", layer) for layer in range(4)]
    assert log == expected
    gather.close()
    assert sync.overlap is None


def test_finish_waits_for_a_bucket_no_forward_read_and_gather_now_waits_for_all():
    log: list[tuple[str, int]] = []
    model, sync = _stage(log)
    gather = ParamGather(sync, list(model))
    gather.start()
    model[1:](torch.randn(2, 8))  # layer 0 does not run: its bucket is left
    readers = first_readers(sync.buckets, list(model))
    left = [i for i in forward_order(readers) if readers[i] == 0]
    log.clear()
    gather.wait_all()
    assert log == [("wait", i) for i in left]
    log.clear()
    gather.gather_now()
    order = forward_order(readers)
    assert log == [("issue", i) for i in order] + [("wait", i) for i in order]


def test_a_parameter_shared_by_two_layers_is_read_first_by_the_earlier():
    shared = nn.Linear(8, 8)
    layers = [shared, nn.Linear(8, 8), shared]
    buckets = plan_buckets(ready_order([list(m.parameters()) for m in layers]), 1, 1)
    assert first_readers(buckets, layers) == [0]


def test_the_flag_needs_shard_optimizer():
    with pytest.raises(ConfigError, match="--overlap-param-gather needs --shard-optimizer"):
        RunConfig(overlap_param_gather=True, dp=2)
    assert RunConfig(overlap_param_gather=True, shard_optimizer=True, dp=2).overlap_param_gather
