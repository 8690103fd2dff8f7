"""memory/state_bytes.py: parameters, gradients and optimizer state counted by storage, each storage once."""

from __future__ import annotations

import torch

from peerline.distributed.memory.state_bytes import state_bytes


def test_each_storage_once_by_kind() -> None:
    flat = torch.zeros(100)  # two parameters as views of one flat buffer, as --shard-optimizer lays them out
    a, b = torch.nn.Parameter(flat[:60].view(6, 10)), torch.nn.Parameter(flat[60:].view(4, 10))
    c = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    grads = torch.zeros(100)  # bucket views
    a.grad, b.grad, c.grad = grads[:60].view(6, 10), grads[60:].view(4, 10), torch.zeros(5, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([a, b, c], lr=1e-3)
    assert state_bytes([a, b, c], opt) == {"parameters": 400 + 10, "gradients": 400 + 10, "optimizer_state": 0}
    opt.step()
    moments = 2 * (60 + 40) * 4 + 2 * 5 * 2  # fp32 moments of a and b, bf16 moments of c
    steps = 3 * 4  # one fp32 step count per parameter (a CPU tensor of the default dtype)
    assert state_bytes([a, b, c], opt)["optimizer_state"] == moments + steps
    assert state_bytes([a, a, b], opt)["parameters"] == 400  # a parameter listed twice counts once


def test_a_sharded_optimizers_gradient_shards_count_beside_the_buckets() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.zeros(8)
    shard = torch.nn.Parameter(p.data[:4])
    shard.grad = torch.zeros(4)  # the reduce-scattered shard: a buffer of its own
    opt = torch.optim.AdamW([shard], lr=1e-3)
    assert state_bytes([p], opt) == {"parameters": 32, "gradients": 32 + 16, "optimizer_state": 0}


def test_the_split_of_the_highest_peak() -> None:
    from peerline.distributed.memory.state_bytes import describe_split

    held = {"parameters": [2**30, 2**31], "gradients": [2**30, 2**31], "optimizer_state": [2**32, 2**33]}
    assert describe_split(held, [8.0, 15.5]) == ("rank 1 (the highest peak): parameters 2.00, gradients 2.00, "
                                                 "optimizer 8.00, the rest 3.50 GiB")
    assert describe_split(held, []) == "" and describe_split({}, [1.0]) == ""
