"""A Linear whose weight gradient is accumulated straight into the fp32 `.grad` (Megatron-LM's
"gradient_accumulation_fusion").

The weights are fp32 masters, the compute runs in bf16 under autocast, and M microbatches accumulate gradients.
Under plain nn.Linear + autocast, every backward of every microbatch computes dW in bf16 into a new tensor, casts
it to another new fp32 tensor (ToCopyBackward) and adds that into `.grad` (AccumulateGrad): about 20 bytes of
memory traffic per parameter per microbatch besides the GEMM. Here dW goes into `.grad` by one GEMM with beta=1
and an fp32 output (`aten::addmm.dtype_out`, bf16 inputs, fp32 accumulator): 8 bytes per parameter, and no
allocation, so the backward stays safe to capture in a CUDA graph.

  forward   x -> compute dtype (autocast's, else the weight's); the weight's low-precision copy is made once per
            iteration (a cache keyed by `new_iteration()`'s epoch and the weight's version); y = x @ w.T + b
  backward  dx = dy @ w;  weight.grad += dy.T @ x  in place (fp32 accumulate);  db = sum(dy) in fp32
            (returned to autograd: tiny). The weight is hidden from autograd, so no AccumulateGrad runs for it:
            the parameter's post-accumulate-grad hooks (bucketed all-reduce) are called here instead, once per
            backward, after the accumulation is queued.

Under `--kernels auto`, an eager forward (no graph capture) runs plain F.linear where this Python Function's host
time costs more than it saves on the device. An fp32 weight under autocast runs it below the card's eager threshold
for "linear" (the saving, a weight cast and dW's cast and add per microbatch, grows with the weight). A weight
already in the compute dtype (the bf16, master and compact recipes; the saving is the add of dW into `.grad`) runs
it where its GEMM is below EAGER_FUSED_MIN_MACS multiply-adds per call: only longer GEMMs keep the device behind
the host, so that the Function's host time is hidden. Captured forwards and `--kernels peerline` keep the fused
path; on the CPU a weight in the compute dtype always runs F.linear.

The fp32 `addmm.dtype_out` path is checked once per process by `probe()` on a tiny exact problem, outside any
graph capture; if the op is missing or wrong, the backward falls back to `weight.grad.add_(dy.T @ x)` (one
logged line). `.grad` must already exist for a captured backward (peerline's gradient syncs create them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.kernels.capture_state import capturing

log = logging.getLogger(__name__)

_epoch = 0
# Not None while a split backward's input-gradient pass runs (defer_weight_grads): dW work is queued here as
# (weight, dy, x) for the weight-gradient pass instead of running now.
_deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
# None: not probed yet; True: aten::addmm.dtype_out accumulates bf16/fp16 products into fp32 in place correctly.
_dtype_out_ok: bool | None = None


def new_iteration() -> None:
    """Invalidate every cached low-precision weight copy: the engine calls this at the start of each iteration
    (weights change in the optimizer step, and a checkpoint restore may change them without a version bump)."""
    global _epoch
    _epoch += 1


@dataclass
class CastCache:
    """One module's cached low-precision copy of its weight (and bias), valid for one (epoch, version, dtype)."""

    key: tuple | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (_epoch, weight._version, weight.data_ptr(), dtype,
               None if bias is None else (bias._version, bias.data_ptr()))
        if key != self.key:
            with torch.no_grad():
                self.weight = weight.detach().to(dtype)
                self.bias = None if bias is None else bias.detach().to(dtype)
            self.key = key
        return self.weight, self.bias


def probe(device: torch.device) -> bool:
    """Check once per process that addmm.dtype_out adds low-precision products into an fp32 tensor in place
    (self aliasing out, a transposed mat1, beta=1), exactly on small integers. Host sync: call outside an
    iteration (the first forward on a GPU does)."""
    global _dtype_out_ok
    if _dtype_out_ok is not None:
        return _dtype_out_ok
    if device.type != "cuda":
        return False  # the CPU runs fp32 (plain addmm_) or the fallback; not worth a probe
    if torch.cuda.is_current_stream_capturing():
        # Cannot sync inside a capture: use the fallback for this process rather than guess.
        _dtype_out_ok = False
        log.warning("fused linear: first use inside a CUDA graph capture; dW accumulated by the fallback "
                    "(weight.grad.add_(dy.T @ x))")
        return False
    reason = ""
    try:
        gen = torch.Generator(device=device).manual_seed(1234)
        with torch.no_grad(), torch.autocast("cuda", enabled=False):
            acc = torch.randint(-64, 65, (24, 40), device=device, generator=gen).float()
            dy = torch.randint(-4, 5, (56, 24), device=device, generator=gen).to(torch.bfloat16)
            x = torch.randint(-4, 5, (56, 40), device=device, generator=gen).to(torch.bfloat16)
            want = acc.double() + dy.double().T @ x.double()
            ptr = acc.data_ptr()
            torch.ops.aten.addmm.dtype_out(acc, dy.T, x, torch.float32, beta=1, alpha=1, out=acc)
            ok = acc.data_ptr() == ptr and acc.dtype == torch.float32 and bool(torch.equal(acc.double(), want))
            if not ok:
                reason = "wrong result"
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _dtype_out_ok = ok
    if not ok:
        log.warning("fused linear: aten::addmm.dtype_out unusable (%s); dW accumulated by the fallback "
                    "weight.grad.add_(dy.T @ x)", reason)
    return ok


class AutocastOff:
    """Autocast switched off for one device type inside the region, and back to what it was after; reentrant.

    The cheap form of `torch.autocast(device_type, enabled=False)` for hot paths (the engine's non-forward steps,
    this module's backward): one query and two switches, where torch.autocast also builds and checks an object and
    saves and restores its dtype and cache state (unchanged here: the dtype does not matter while autocast is
    off, and the cast cache is kept; an enclosing region still clears it when it ends)."""

    __slots__ = ("device_type", "_prev")

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._prev: list[bool] = []

    def __enter__(self) -> None:
        self._prev.append(torch.is_autocast_enabled(self.device_type))
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc: object) -> bool:
        torch.set_autocast_enabled(self.device_type, self._prev.pop())
        return False


_autocast_off: dict[str, AutocastOff] = {}


def autocast_off(device_type: str) -> AutocastOff:
    """The `AutocastOff` region of `device_type`, one object per device type made once (for one thread's hot path:
    its saved states form one stack)."""
    off = _autocast_off.get(device_type)
    if off is None:
        off = _autocast_off[device_type] = AutocastOff(device_type)
    return off


class defer_weight_grads:
    """Within the block, fused Linears queue their weight gradients into `queue` (run them with
    `accumulate_deferred`); a backward node run again later (the weight pass re-running it for a bias) then skips
    its dW and dx, already done or queued."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        global _deferred
        _deferred = self.queue
        return self.queue

    def __exit__(self, *exc: object) -> None:
        global _deferred
        _deferred = None


def accumulate_deferred(queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Run the weight gradients `defer_weight_grads` queued, with the weights' post-accumulate-grad hooks."""
    # Outside the autograd engine grad mode is on, and x (a saved activation) requires grad: without no_grad the
    # in-place GEMM into .grad would be recorded, which autograd refuses for a leaf's gradient.
    with torch.no_grad(), torch.autocast(queue[0][1].device.type if queue else "cpu", enabled=False):
        for weight, dy, x in queue:
            _accumulate_weight_grad(weight, dy, x)
            _call_post_accumulate_hooks(weight)
    queue.clear()


def _call_post_accumulate_hooks(param: torch.Tensor) -> None:
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if hooks:
        for hook in hooks.values():
            hook(param)


def _accumulate_weight_grad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """weight.grad += dy.T @ x, in place, in weight.grad's dtype."""
    grad = weight.grad
    if grad is None:
        # Outside peerline's runtime (which creates every .grad up front): allocate once. Not capturable.
        weight.grad = grad = torch.zeros_like(weight)
    if dy.dtype == grad.dtype:
        grad.addmm_(dy.T, x)
    elif _dtype_out_ok and dy.is_cuda and grad.dtype == torch.float32 and grad.is_contiguous():
        torch.ops.aten.addmm.dtype_out(grad, dy.T, x, torch.float32, beta=1, alpha=1, out=grad)
    else:
        grad.add_(dy.T @ x)


class _LinearAccumulate(torch.autograd.Function):
    """y = x @ w_c.T + b_c with x, w_c, b_c already in the compute dtype. The fp32 master weight travels inside a
    tuple, so autograd does not see it as an input: no AccumulateGrad node exists for it (that node would also
    run the weight's post-accumulate-grad hooks, a second time), and backward accumulates into its .grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, master: tuple[torch.Tensor], w_c: torch.Tensor, bias: torch.Tensor | None,
                b_c: torch.Tensor | None) -> torch.Tensor:
        # x, w_c and b_c are all in the compute dtype (autocast's where it is on), so autocast would cast nothing:
        # no region to switch it off (that costs more host time than the GEMM launch on small shapes).
        y = F.linear(x, w_c, b_c)  # the reference's own kernel (addmm with a bias epilogue)
        ctx.save_for_backward(x, w_c)
        ctx.weight = master[0]
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        device_type = dy.device.type
        if torch.is_autocast_enabled(device_type):  # a backward run under autocast: use the dtypes as they are
            with AutocastOff(device_type):
                return _LinearAccumulate._grads(ctx, dy)
        return _LinearAccumulate._grads(ctx, dy)

    @staticmethod
    def _grads(ctx, dy: torch.Tensor) -> tuple:
        x, w_c = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.dtype != w_c.dtype:
            dy2 = dy2.to(w_c.dtype)
        dx = db = None
        rerun = getattr(ctx, "deferred", False)  # dx and dW were done (or queued) by the input-gradient pass
        needs = ctx.needs_input_grad  # a tuple made per read
        if needs[0] and not rerun:
            dx = (dy2 @ w_c).view(*dy.shape[:-1], w_c.shape[1])
        weight = ctx.weight
        if weight.requires_grad and not rerun:
            if _deferred is not None:
                _deferred.append((weight, dy2, x2))
            else:
                _accumulate_weight_grad(weight, dy2, x2)
                _call_post_accumulate_hooks(weight)
        if ctx.has_bias and needs[3]:
            db = dy2.sum(0, dtype=ctx.bias_dtype)
        ctx.deferred = rerun or _deferred is not None
        return dx, None, None, db, None


def linear_accumulate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      cache: CastCache) -> torch.Tensor:
    """F.linear(x, weight, bias) with the same autocast semantics (compute in autocast's dtype where enabled),
    whose weight gradient is accumulated in place into weight.grad (see the module doc)."""
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        # The weight is hidden from autograd (see _LinearAccumulate): with no other input needing a gradient the
        # backward would never run. Rare (a first layer without bias on plain data): the reference path.
        return F.linear(x, weight, bias)
    dtype = compute_dtype(x, weight)
    if dtype == weight.dtype:
        w_c, b_c = weight.detach(), None if bias is None else bias.detach()
    else:
        if _dtype_out_ok is None and x.is_cuda:
            probe(x.device)
        w_c, b_c = cache.get(weight, bias, dtype)
    if x.dtype != dtype:
        x = x.to(dtype)  # autograd's own cast (ToCopyBackward casts dx back), as autocast does
    return _LinearAccumulate.apply(x, (weight,), w_c, bias, b_c)


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the GEMM runs in: autocast's where autocast is on for x's device, else the weight's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


#: The multiply-adds per call (rows x in x out) at and above which an eager GEMM of a weight already in the compute
#: dtype takes the fused path: about 0.15 ms forward on an H100 or H200. The MLP's 4096 x 2048 x 8192 (2^36) ran
#: faster fused in eager runs on an H200, pp=2 and one GPU; the GPT block's 2048 x 2048 x 8192 (2^35), with several
#: times the host work per GEMM FLOP, stays on F.linear (the eager suite's records: docs/benchmarks).
EAGER_FUSED_MIN_MACS = 1 << 36


def eager_plain(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """--kernels auto: whether this forward runs plain F.linear (see the module doc), outside a graph capture only:
    a low-precision weight already in the compute dtype on the CPU, or on a GPU where its GEMM is short (below
    EAGER_FUSED_MIN_MACS); an fp32 weight under autocast on a GPU below the card's eager threshold for "linear"
    (`small_for_eager`)."""
    if x.is_cuda and capturing():
        return False
    if weight.dtype in (torch.bfloat16, torch.float16):
        return compute_dtype(x, weight) == weight.dtype and (
            not x.is_cuda or x.numel() // max(x.shape[-1], 1) * weight.numel() < EAGER_FUSED_MIN_MACS)
    return (weight.dtype == torch.float32 and x.is_cuda and torch.is_autocast_enabled(x.device.type)
            and small_for_eager(weight))


# (weight elements, device index) -> whether an eager autocast forward of that weight runs plain F.linear
_EAGER_SMALL: dict[tuple[int, int], bool] = {}


def small_for_eager(weight: torch.Tensor) -> bool:
    """The card table's pick for "linear" (card_table.CardTable.pick) by the fp32 weight's bytes: torch below the
    eager threshold (64 MiB where unmeasured). Below it the GEMMs are short and the host is the bottleneck: autocast's
    per-microbatch weight cast and torch's C++ nodes cost less host time than this module's Python Function, whose
    saving (no cast, dW added in the GEMM) is device traffic. Cached per size and device."""
    key = (weight.numel(), weight.device.index or 0)
    hit = _EAGER_SMALL.get(key)
    if hit is None:
        from peerline.kernels.card_table import TORCH
        from peerline.kernels.elementwise import card_table

        hit = _EAGER_SMALL[key] = card_table(key[1]).pick("linear", "fp32", 4 * key[0], eager=True) == TORCH
    return hit


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, impl: str = "torch",
           cache: CastCache | None = None) -> torch.Tensor:
    """F.linear; with impl="peerline" or "auto" (and a weight that will get a gradient) the weight's gradient is
    accumulated in place into weight.grad by `linear_accumulate`, and its low-precision copy comes from `cache` once per
    iteration, except where "auto" picks F.linear for an eager forward (`eager_plain`). ops.linear is this
    function."""
    if impl != "torch" and weight.requires_grad and torch.is_grad_enabled() and not (
            impl == "auto" and eager_plain(x, weight)):
        if cache is None:
            cache = CastCache()  # no reuse across microbatches: the caller should keep one
        return linear_accumulate(x, weight, bias, cache)
    return F.linear(x, weight, bias)


class FusedLinear(nn.Linear):
    """nn.Linear (same parameters, initialisation and state_dict) whose forward uses `linear_accumulate` when
    `impl` is "peerline" or "auto", plain F.linear (the reference) otherwise."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, impl: str = "torch") -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.impl = impl
        self._cast_cache = CastCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.impl, self._cast_cache)

    def with_bias(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """The forward of a Linear built without a bias, with `bias` (a parameter kept beside it) added in the GEMM's
        epilogue."""
        if self.bias is not None:
            raise ValueError("with_bias: this Linear has a bias of its own")
        return linear(x, self.weight, bias, self.impl, self._cast_cache)

    def forward_bias_grad_elsewhere(self, x: torch.Tensor) -> torch.Tensor:
        """The forward with the bias added in the GEMM's epilogue but outside autograd: its gradient is summed by
        another node (FusedLayerNorm.with_residual's backward), so this Linear's backward sums nothing for it."""
        if self.bias is None:
            raise ValueError("forward_bias_grad_elsewhere: this Linear has no bias")
        return linear(x, self.weight, self.bias.detach(), self.impl, self._cast_cache)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}"
