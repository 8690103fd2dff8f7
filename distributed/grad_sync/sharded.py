"""`--shard-optimizer` (ZeRO-1 over the dp group): flat buckets whose gradients are reduce-scattered, not
all-reduced, and whose parameters live in flat buffers too, so each rank owns one contiguous shard of every bucket.

The layout is GradBuckets' (buckets.py: DDP's cut, in backward's ready order), with every bucket padded to a
multiple of dp x the alignment (`pad_for_shards`), so the dp shards of a bucket are equal-sized and each starts
aligned; the padding holds zeros that stay zero (no gradient, no weight decay of 0). Rank r of the dp group owns
elements [r*S, (r+1)*S) of a bucket of dp*S elements (`shard_range`).

One iteration, as the engine drives it (the hooks, arm() and finish() are GradBuckets' own):

  backward      a complete bucket's flat gradient is reduce-scattered (average) into this rank's gradient shard,
                on the all-reduce stream, overlapped with the rest of backward as the all-reduce was
  step          the optimizer (sharded_adamw.py) updates only the shards: its parameters are views of this rank's
                shard of each bucket's flat parameter buffer, their `.grad` the reduce-scattered shard
  gather        after the step, every bucket's updated shard is all-gathered in place into the flat parameter
                buffer, i.e. into the parameters themselves (on the all-reduce stream, the main stream waiting);
                with --overlap-param-gather param_gather.py issues them at the next iteration's start instead and
                the forward waits per bucket (`overlap`)

Every buffer is made once here; nothing allocates or synchronizes the host per iteration, so the iteration is
captured in the CUDA graph as before (NCCL's reduce-scatter and all-gather are capturable; gloo runs eager).

The buffers keep the parameters' dtype: fp32 (autocast, fp32 master) or bf16 (master with bf16 compute, whose
optimizer keeps fp32 masters of the shards; bf16). The optimizer (sharded_adamw.py) decides the state's dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from peerline.distributed.config import ConfigError
from peerline.distributed.grad_sync.buckets import ALIGN_BYTES, Bucket, GradBuckets
from peerline.distributed.streams import use, wait_stream

log = logging.getLogger(__name__)

# torch 2.13 renames the tensor collectives (same arguments) and warns on the old names; older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pad_for_shards(buckets: Sequence[Bucket], dp: int) -> list[int]:
    """Pad every bucket to a multiple of dp x the alignment (in elements of its dtype) and lay each dtype's buckets
    end to end again in index order (the order they tile their flat buffer); returns each bucket's shard size in
    elements. Parameters keep their offsets inside their bucket (`starts`)."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    ends: dict[torch.dtype, int] = {}
    shards = []
    for b in buckets:
        step = max(1, ALIGN_BYTES // torch.empty((), dtype=b.dtype).element_size()) * dp
        b.numel = -(-b.numel // step) * step
        b.offset = ends.get(b.dtype, 0)
        ends[b.dtype] = b.offset + b.numel
        shards.append(b.numel // dp)
    return shards


def shard_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of dp rank `rank`'s shard of a bucket of `numel` elements (padded: a multiple of dp)."""
    if numel % dp or not 0 <= rank < dp:
        raise ValueError(f"a bucket of {numel} elements has no shard {rank} of {dp} equal ones")
    size = numel // dp
    return rank * size, (rank + 1) * size


class ShardedGradBuckets(GradBuckets):
    """GradBuckets that reduce-scatter each bucket and keep the parameters in flat buffers (see the module doc).

    `param_shards[i]` / `grad_shards[i]`: this rank's shard of bucket i's parameters (a view: writing it writes the
    parameters) and its reduce-scattered, averaged gradient (a buffer of its own). `gather_params()` all-gathers
    the shards back into the parameters. Needs a dp group (dp > 1); the other arguments are GradBuckets'. The
    all-gathers after the step run on `tail_group` when given (NCCL's uncapped twin: nothing overlaps them), else on
    `group`; overlapped ones (param_gather.py) on each bucket's own group, as its reduce-scatter.
    """

    def __init__(self, layers: Sequence[Sequence[torch.nn.Parameter]], group: dist.ProcessGroup,
                 device: torch.device, stream: torch.cuda.Stream | None = None, bucket_mb: float = 25,
                 first_bucket_mb: float = 1, timing: bool = True, tail_group: dist.ProcessGroup | None = None,
                 tail_layers: int = 1) -> None:
        if group is None or dist.get_world_size(group) < 2:
            raise ValueError("ShardedGradBuckets needs a data-parallel group of 2 or more ranks")
        self.gather_group = tail_group if tail_group is not None else group
        self.dp_rank = dist.get_rank(group)
        #: param_gather.py's ParamGather once --overlap-param-gather attaches one: it gathers, not after_step()
        self.overlap: Any = None
        super().__init__(layers, group, device, stream=stream, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
                         timing=timing, tail_group=tail_group, tail_layers=tail_layers)

    def _build_flat(self) -> None:
        """Pad the buckets into equal shards, then GradBuckets' gradient buffers, then the parameter buffers."""
        wrong = sorted({str(b.dtype) for b in self.buckets if b.dtype not in (torch.float32, torch.bfloat16)})
        if wrong:
            raise ConfigError(f"--shard-optimizer shards fp32 and bf16 parameters; this stage has "
                              f"{', '.join(wrong)} parameters")
        self.shard_numels = pad_for_shards(self.buckets, self.dp)
        super()._build_flat()
        self._build_param_flat()

    def _build_param_flat(self) -> None:
        """One flat parameter buffer per dtype, laid out as the gradients; each parameter's data becomes a view."""
        self.param_flat = {dt: torch.zeros_like(flat) for dt, flat in self.flat.items()}
        self.param_buckets: list[torch.Tensor] = []
        self.param_shards: list[torch.Tensor] = []
        self.grad_shards: list[torch.Tensor] = []
        with torch.no_grad():
            for b, size in zip(self.buckets, self.shard_numels, strict=True):
                bucket = self.param_flat[b.dtype][b.offset:b.offset + b.numel]
                for p, start in zip(b.params, b.starts, strict=True):
                    view = bucket[start:start + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                lo, hi = shard_range(b.numel, self.dp, self.dp_rank)
                self.param_buckets.append(bucket)
                self.param_shards.append(bucket[lo:hi])
                self.grad_shards.append(torch.zeros(size, dtype=b.dtype, device=self.device))
        if self.on_cuda:  # as GradBuckets: the copies ran on the building stream; outside any iteration
            torch.cuda.current_stream(self.device).synchronize()
        log.info("sharded optimizer: dp rank %d of %d owns %d of %d elements", self.dp_rank, self.dp,
                 sum(self.shard_numels), sum(b.numel for b in self.buckets))

    def _collective(self, index: int, op: Any, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Reduce-scatter bucket `index` into this rank's gradient shard (the rest of the bucket is left summed
        locally only: nothing reads it)."""
        out = self.grad_shards[index]
        work = _reduce_scatter(out, self._slices[index], op=op, group=self.bucket_groups[index],
                               async_op=async_op)
        return work, out

    def after_step(self) -> None:
        """The optimizer's step post-hook: gather the updated shards now, unless an overlap (param_gather.py)
        gathers them at the next iteration's start."""
        if self.overlap is None:
            self.gather_params()

    def finish(self) -> None:
        """GradBuckets.finish, after waiting for every overlapped all-gather no forward waited for (a bucket
        whose layers did not run): each reads the shard that the step writes next."""
        if self.overlap is not None:
            self.overlap.wait_all()
        super().finish()

    def gather_params(self) -> None:
        """All-gather every bucket's shard into its flat parameter buffer, in place (after the optimizer step).
        On a GPU on the all-reduce stream, ordered after the current stream's work and before its next."""
        current = torch.cuda.current_stream(self.device) if self.on_cuda else None
        stream = self.stream if self.on_cuda else None
        wait_stream(stream, current)
        with use(stream):
            for i in range(len(self.buckets)):
                self.gather_bucket(i, self.gather_group)
        wait_stream(current, stream)

    def gather_bucket(self, index: int, group: dist.ProcessGroup, async_op: bool = False) -> Any:
        """All-gather bucket `index`'s shard into its flat parameter buffer, in place, on the current stream over
        `group` (a dp group); gloo's Work when `async_op`, else None."""
        return _all_gather(self.param_buckets[index], self.param_shards[index], group=group, async_op=async_op)

    def gather_shard(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """Bucket `index` whole, gathered from every rank's `shard` of it (collective over the dp group; a new
        tensor: checkpoints, outside iterations)."""
        full = torch.empty(self.buckets[index].numel, dtype=shard.dtype, device=shard.device)
        _all_gather(full, shard.contiguous(), group=self.gather_group)
        return full

    def shard_of(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole bucket-sized tensor (a view)."""
        lo, hi = shard_range(self.buckets[index].numel, self.dp, self.dp_rank)
        return full[lo:hi]
