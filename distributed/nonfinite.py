"""Non-finite loss policy: stop with the iteration number, or (--skip-nonfinite) skip the step on every rank.

Only the last stage sees the loss, but every rank must take the same decision, or the ranks that step and the
ranks that do not drift apart (and the ones that stop leave the others hanging). `NonFiniteGuard` agrees on
device, with no host synchronization, so it works inside a captured iteration:

  guard = NonFiniteGuard(device, skip=cfg.skip_nonfinite, group=world_group)
  guard.prepare(optimizer)                   # once; checks the optimizer can skip on device
  ... forward / backward / gradient all-reduce of one iteration ...
  guard.update(loss_sum_or_None, grads)      # flag = any rank saw a non-finite loss or gradient (all-reduce MAX)
  guard.step(optimizer)                      # fused optimizers skip on device when the flag is set
  ... after the iteration (where the host reads the loss anyway):
  check_finite(loss_value, it, skip, flagged=guard.flagged())  # raise on every rank, or log the skipped step

The fused Adam/AdamW/SGD kernels accept a `found_inf` tensor (the mechanism AMP's GradScaler uses): when it is
non-zero the update, the moments and the step count stay as they were, all on device. Other optimizers fall
back to one host read of the flag before `step()`, and say so once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss of an iteration is NaN or infinite; the message names the iteration."""


def check_finite(loss_value: float, iteration: int, skip: bool, flagged: bool | None = None) -> bool:
    """Host-side policy after an iteration. True: the step counts. False: it was non-finite and skipped (only with
    `skip`). Otherwise raises NonFiniteLossError naming `iteration`.

    `flagged` is the all-ranks agreement of `NonFiniteGuard.flagged()`; pass it on ranks that do not see the
    loss (its value is then ignored), so every rank raises or skips at the same iteration."""
    bad = flagged if flagged is not None else not math.isfinite(loss_value)
    if not bad:
        return True
    shown = f"{loss_value:g}" if isinstance(loss_value, float) else str(loss_value)
    if skip:
        log.warning("non-finite loss (%s) at iteration %d: step skipped on every rank", shown, iteration)
        return False
    raise NonFiniteLossError(f"non-finite loss ({shown}) at iteration {iteration}; "
                             "rerun with --skip-nonfinite to skip such steps")


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused")) and type(optimizer).__name__ in {"Adam", "AdamW", "SGD"}


class NonFiniteGuard:
    """All-ranks, on-device agreement that an iteration produced a non-finite loss or gradient."""

    def __init__(self, device: torch.device, skip: bool, group: dist.ProcessGroup | None = None) -> None:
        self.skip = skip
        self.group = group
        self.flag = torch.zeros((), dtype=torch.float32, device=device)  # static: same address in every replay
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._on_device = True

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Decide how a skip is done for this optimizer (call once, outside capture)."""
        self._on_device = _supports_found_inf(optimizer)
        if self.skip and not self._on_device:
            log.warning("--skip-nonfinite with a non-fused %s: the skip decision reads one flag on the host per "
                        "iteration", type(optimizer).__name__)

    def update(self, loss: torch.Tensor | None, grads: Iterable[torch.Tensor] = ()) -> torch.Tensor:
        """Set the flag from this rank's loss (if it has one) and gradients, then agree across ranks (MAX)."""
        self.flag.zero_()
        if loss is not None:
            self.flag.copy_(torch.logical_not(torch.isfinite(loss)).any())
        grads = [g for g in grads if g is not None]
        if grads:
            by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault((g.device, g.dtype), []).append(g)
            for gs in by_dtype.values():
                # Sets flag to 1 where any gradient holds inf/NaN; inv_scale 1 leaves the gradients unchanged.
                torch._amp_foreach_non_finite_check_and_unscale_(gs, self.flag, self._one)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return self.flag

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`, skipped on every rank when the flag is set and skipping is on."""
        if not self.skip:
            optimizer.step()
            return
        if self._on_device:
            optimizer.found_inf = self.flag  # read by the fused kernels; see torch.optim.adam._fused_adam
            optimizer.step()
        elif self.flag.item() == 0:
            optimizer.step()

    def flagged(self) -> bool:
        """Host read of the agreed flag (synchronizes: call after the iteration)."""
        return bool(self.flag.item())
