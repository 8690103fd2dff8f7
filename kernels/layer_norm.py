"""LayerNorm over the last dimension with bf16 input, output and parameters and fp32 statistics, as one kernel
forward and one backward plus a small reduction (kernels/layer_norm.cu; Transformer Engine's and Apex's fused
LayerNorm do the same: each row's statistics in registers, the weight and bias gradients summed from per-block
partials).

  forward   a block takes a few rows at a time (their loads in flight together), reads x once (16-byte loads),
            takes the mean and variance from registers, writes y and keeps mean and rstd [rows] (fp32) for the
            backward
  backward  reads x and dy once: dx, and each block's partial sums of dg and db over the rows it took, which
            pl_ln_reduce adds in a fixed order, warps in parallel (a repeatable sum: graph and eager runs agree to
            the bit)
  residual  for a pre-norm block y = x + f(norm(x)): the residual's gradient read in the same pass and added into
            dx, and optionally its sums over the rows (the bias gradient of f's last Linear) as a third partial
            (flash-attention's dropout_add_layer_norm, after Apex's FastLayerNorm, adds the residual's gradient
            the same way); no separate add of x's two gradients, no separate column sum

`FusedLayerNorm` is nn.LayerNorm (same parameters, state_dict and init) whose forward takes this path for CUDA bf16
inputs and bf16 parameters with a width the kernels take (`fused_supported`), and torch's layer_norm everywhere
else: fp32 runs, the CPU, `--kernels torch`. Under `--kernels auto` an eager launch (no graph capture) below the
card's `eager_torch_below` bytes for "layer_norm" (card_table.py; 64 MiB where unmeasured) runs torch's op too:
there the autograd Function's host time (Python, three launches) costs more than the kernels save on the device,
while a captured launch pays no host time at replay; a captured launch below CAPTURED_TORCH_BELOW bytes runs
torch's op as well, which takes less device time on small tensors. On the CPU the same autograd Function runs with
torch's native layer norm ops standing in for the kernels, so CI checks its contract; the kernels are checked
against float64 on a GPU (tests/gpu/test_layer_norm_gpu.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from peerline.kernels.capture_state import capturing

KERNEL_SOURCE = Path(__file__).resolve().parent / "layer_norm.cu"
THREADS = 256  # PL_LN_THREADS in layer_norm.cu
VECTORS = (1, 2, 4)  # the kernels' register capacities: 16-byte vectors per thread
MAX_WIDTH = 8 * THREADS * VECTORS[-1]
REDUCE_COLUMNS = 32  # columns per block of pl_ln_reduce (a warp's lanes)
ROW_VECTORS = 4  # PL_LN_ROW_VECTORS in layer_norm.cu
BACKWARD_BLOCKS_PER_SM = 2  # PL_LN_BWD_BLOCKS in layer_norm.cu
# Bytes read and written (4 per element in bf16) below which a captured --kernels auto launch runs torch's layer
# norm: torch's is faster on a 512 x 512 tensor (1 MiB), the kernels from 2048 x 2048 (16 MiB) on (docs/benchmarks/
# code-notes.md).
CAPTURED_TORCH_BELOW = 4 << 20


def rows_at_a_time(vectors: int) -> int:
    """Rows a block of the kernels takes at once for a register capacity (R in layer_norm.cu)."""
    return max(1, ROW_VECTORS // vectors)


def fused_supported(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the kernels take this LayerNorm: CUDA, x, weight and bias all bf16, a width that is a multiple of 8
    and at most MAX_WIDTH."""
    width = x.shape[-1]
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight is not None and bias is not None
            and weight.dtype == bias.dtype == torch.bfloat16 and width % 8 == 0 and 0 < width <= MAX_WIDTH)


def vectors_for(width: int) -> int:
    """The smallest register capacity (16-byte vectors per thread) that holds a row of `width` elements."""
    for v in VECTORS:
        if width <= 8 * THREADS * v:
            return v
    raise ValueError(f"fused LayerNorm takes rows of at most {MAX_WIDTH} elements, not {width}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _kernel(name: str, device: torch.device):
    from peerline.kernels.compile import load_kernel

    return load_kernel(KERNEL_SOURCE, name, device.index)[0]


def layer_norm_forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2 [rows, H] -> (y [rows, H], mean [rows], rstd [rows]); the kernel on CUDA, torch's op on the CPU."""
    rows, width = x2.shape
    if not x2.is_cuda:
        y, mean, rstd = torch.native_layer_norm(x2, [width], weight, bias, eps)
        return y, mean.view(rows), rstd.view(rows)
    from peerline.kernels.elementwise import launch_raw

    y = torch.empty_like(x2)
    mean = torch.empty(rows, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    if rows:
        vectors = vectors_for(width)
        kernel = _kernel(f"pl_ln_forward_{vectors}", x2.device)
        launch_raw(kernel, min(-(-rows // rows_at_a_time(vectors)), 65535), THREADS, "ppppppqif",
                   (x2.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), mean.data_ptr(),
                    rstd.data_ptr(), rows, width, eps), x2.device)
    return y, mean, rstd


def layer_norm_backward(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        mean: torch.Tensor, rstd: torch.Tensor, residual: torch.Tensor | None = None,
                        residual_sum: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx [rows, H], dweight [H], dbias [H], residual's column sums [H] or None) in the parameters' dtype; the
    kernels on CUDA, torch's ops on the CPU. `residual` [rows, H]: the gradient of a branch that also reads x, added
    to dx in the same pass; with `residual_sum` its sums over the rows come back too (the bias gradient of a Linear
    whose output that gradient is). The partial sums: one fp32 row per sum and block, BACKWARD_BLOCKS_PER_SM blocks
    per multiprocessor."""
    rows, width = x2.shape
    if not x2.is_cuda:
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dy2, x2, [width], mean.view(rows, 1), rstd.view(rows, 1), weight, bias, [True, True, True])
        if residual is None:
            return dx, dweight, dbias, None
        acc = torch.promote_types(x2.dtype, torch.float32)  # the kernels' fp32 sums; float64 stays float64
        summed = residual.sum(0, dtype=acc).to(bias.dtype) if residual_sum else None
        return (dx.to(acc) + residual.to(acc)).to(dx.dtype), dweight, dbias, summed
    from peerline.kernels.elementwise import launch_raw

    dx = torch.empty_like(x2)
    sums = 3 if residual_sum else 2
    outputs = [torch.empty_like(weight), torch.empty_like(bias)] + ([torch.empty_like(bias)] if residual_sum else [])
    parts = max(1, min(rows, BACKWARD_BLOCKS_PER_SM * _sm_count(x2.device.index)))
    # Every block writes its whole partial rows; with no rows no block runs and the sums are zeros.
    partials = (torch.empty if rows else torch.zeros)(sums, parts, width, dtype=torch.float32, device=x2.device)
    if rows:
        vectors = vectors_for(width)
        head = (dy2.data_ptr(), x2.data_ptr(), weight.data_ptr(), mean.data_ptr(), rstd.data_ptr())
        if residual is None:
            name, sig, args = f"pl_ln_backward_{vectors}", "ppppppppqi", (*head, dx.data_ptr())
        else:
            kind = "res_sum" if residual_sum else "res"
            name, sig = f"pl_ln_backward_{kind}_{vectors}", "p" * (7 + sums) + "qi"
            args = (*head, residual.data_ptr(), dx.data_ptr())
        launch_raw(_kernel(name, x2.device), parts, THREADS, sig,
                   (*args, *(p.data_ptr() for p in partials), rows, width), x2.device)
    launch_raw(_kernel("pl_ln_reduce3" if residual_sum else "pl_ln_reduce", x2.device), -(-width // REDUCE_COLUMNS),
               THREADS, "p" * (2 * sums) + "ii",
               (*(p.data_ptr() for p in partials), *(o.data_ptr() for o in outputs), parts, width), x2.device)
    return dx, outputs[0], outputs[1], (outputs[2] if residual_sum else None)


def _forward_saving(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x) for an autograd Function's forward, keeping x, mean and rstd for its backward (what torch's layer
    norm keeps)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y, mean, rstd = layer_norm_forward(x2, weight, bias, eps)
    ctx.save_for_backward(x2, weight, bias, mean, rstd)
    return y.view(x.shape)


def _backward_saved(ctx, dy: torch.Tensor, residual: torch.Tensor | None = None, residual_sum: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """layer_norm_backward of what _forward_saving kept; dx in dy's shape."""
    x2, weight, bias, mean, rstd = ctx.saved_tensors
    if residual is not None:
        residual = residual.reshape(x2.shape).to(x2.dtype).contiguous()
    dx, dweight, dbias, summed = layer_norm_backward(dy.reshape(x2.shape).contiguous(), x2, weight, bias, mean, rstd,
                                                     residual=residual, residual_sum=residual_sum)
    return dx.view(dy.shape), dweight, dbias, summed


class LayerNormFunction(torch.autograd.Function):
    """x [..., H] -> LayerNorm(x) with weight and bias [H]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return _forward_saving(ctx, x, weight, bias, eps)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx, dweight, dbias, _ = _backward_saved(ctx, dy)
        return dx, dweight, dbias, None


class ResidualLayerNormFunction(torch.autograd.Function):
    """(LayerNorm(x), x) for a pre-norm block y = x + f(LayerNorm(x)): the second output is x itself, to be added
    back as the residual. The backward adds the residual's gradient into dx in the LayerNorm's own pass (no separate
    add of x's two gradients), and where `out_bias` is given (the bias of f's last Linear, whose output gradient is
    the residual's: the block's output gradient) returns that bias's gradient as the residual gradient's sums over
    the rows, so that Linear's backward sums nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                out_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.sum_residual = out_bias is not None
        return _forward_saving(ctx, x, weight, bias, eps), x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dres: torch.Tensor):
        dx, dweight, dbias, dout_bias = _backward_saved(ctx, dy, dres, ctx.sum_residual and ctx.needs_input_grad[4])
        return dx, dweight, dbias, None, dout_bias


# (elements, width, device index) -> whether an eager --kernels auto launch runs the kernels
_EAGER_CHOICE: dict[tuple[int, int, int], bool] = {}


def eager_takes_kernels(x: torch.Tensor) -> bool:
    """--kernels auto, eager: the card table's pick for "layer_norm" (card_table.CardTable.pick: torch below its
    eager threshold, by bytes read and written, 4 per element in bf16). Cached per size; a size that turns to torch
    still loads the kernels once, so a later capture of the same size finds them built (no compiling inside a
    capture)."""
    key = (x.numel(), x.shape[-1], x.device.index)  # the width picks which kernels get loaded
    hit = _EAGER_CHOICE.get(key)
    if hit is None:
        from peerline.kernels.card_table import PEERLINE
        from peerline.kernels.elementwise import card_table

        hit = _EAGER_CHOICE[key] = card_table(x.device.index).pick("layer_norm", "bf16", 4 * x.numel(),
                                                                   eager=True) == PEERLINE
        for name in kernel_names(x.shape[-1]):
            _kernel(name, x.device)
    return hit


def kernel_names(width: int) -> list[str]:
    """The kernels a LayerNorm of rows of `width` may launch: forward, the backward alone and with a residual
    (with and without its sums), the two reductions."""
    v = vectors_for(width)
    return [f"pl_ln_forward_{v}", f"pl_ln_backward_{v}", f"pl_ln_backward_res_{v}", f"pl_ln_backward_res_sum_{v}",
            "pl_ln_reduce", "pl_ln_reduce3"]


def auto_takes_kernels(x: torch.Tensor) -> bool:
    """--kernels auto: a captured launch runs the kernels from CAPTURED_TORCH_BELOW bytes on (below it torch's two
    kernels take less device time than the three launches here), an eager one by eager_takes_kernels."""
    if capturing():
        return 4 * x.numel() >= CAPTURED_TORCH_BELOW
    return eager_takes_kernels(x)


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose forward runs the fused kernels where they apply (see the module doc): `impl` "peerline"
    wherever they take the tensors, "auto" there too except small captured launches and eager launches below the
    card's threshold (auto_takes_kernels), "torch" never."""

    def __init__(self, width: int, eps: float = 1e-5, impl: str = "torch") -> None:
        super().__init__(width, eps=eps)
        self.impl = impl

    def takes_kernels(self, x: torch.Tensor) -> bool:
        """Whether a forward of `x` runs the fused kernels."""
        return self.impl != "torch" and fused_supported(x, self.weight, self.bias) and (
            self.impl == "peerline" or auto_takes_kernels(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_kernels(x):
            return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def with_residual(self, x: torch.Tensor, out_bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(norm(x), the residual x, whether out_bias's gradient comes from here) for a pre-norm block
        y = x + f(norm(x)). Where the kernels run, the residual's gradient joins x's in the LayerNorm's backward
        pass (ResidualLayerNormFunction) and, with `out_bias` (the bias of f's last Linear, a bf16 tensor of the
        width), so does that bias's gradient: the caller then runs that Linear with its bias out of autograd
        (FusedLinear.forward_bias_grad_elsewhere). Elsewhere: (forward(x), x, False)."""
        if not self.takes_kernels(x):  # torch's op, called here: the check above is not made twice
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps), x, False
        summed = out_bias is not None and out_bias.requires_grad and out_bias.dtype == self.bias.dtype and (
            out_bias.shape == self.bias.shape)
        y, residual = ResidualLayerNormFunction.apply(x, self.weight, self.bias, self.eps,
                                                      out_bias if summed else None)
        return y, residual, summed
