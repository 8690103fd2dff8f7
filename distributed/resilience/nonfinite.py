"""Non-finite loss policy: stop with the iteration number, or (--skip-nonfinite) skip the step on every rank; and
the divergence guard: a logged loss above --max-loss-growth times the first logged one stops the run too
(`check_growth`), since a run whose loss explodes (--lr too high) only trains garbage from there.

Only the last stage sees the loss, but every rank must take the same decision, or the ranks that step and the
ranks that do not drift apart (and the ones that stop leave the others hanging). `NonFiniteGuard` agrees on
device, with no host synchronization, so it works inside a captured iteration (resilience/failsafe.py wires it up):

  guard = NonFiniteGuard(device, skip=cfg.skip_nonfinite)
  guard.prepare(optimizer, completed=iterations_done)   # once, before capture
  # in an optimizer step pre-hook, i.e. after the last backward and gradient all-reduce of each iteration:
  guard.update(loss_sum_or_None, grads)   # with skip: all-reduce MAX of the flag over the world
  guard.arm(optimizer)                    # fused optimizers then skip the update on device
  # where the host reads the (agreed) loss anyway:
  check_finite(loss, iteration, skip, first_bad=guard.first_nonfinite())

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


def check_finite(loss_value: float, iteration: int, skip: bool, first_bad: int | None = None) -> bool:
    """Host-side policy for an agreed loss value. True: finite. False: non-finite and `skip` (the step was
    skipped on every rank; logged). Otherwise raises NonFiniteLossError naming the iteration: `first_bad` (the
    first flagged iteration, from `NonFiniteGuard.first_nonfinite`) when known, else `iteration`."""
    if math.isfinite(loss_value):
        return True
    if skip:
        log.warning("non-finite loss (%g) at iteration %d: the step was skipped on every rank", loss_value, iteration)
        return False
    at = first_bad if first_bad is not None else iteration
    raise NonFiniteLossError(f"non-finite loss ({loss_value:g}) at iteration {at}; "
                             "rerun with --skip-nonfinite to skip such steps")


class LossDivergedError(NonFiniteLossError):
    """A logged loss grew past --max-loss-growth times the first one; handled like a non-finite loss (every rank
    sees the same agreed value and stops; rank 0 prints the line; exit 1)."""


def check_growth(loss_value: float, iteration: int, first: tuple[int, float] | None, factor: float) -> None:
    """Raise LossDivergedError when the agreed `loss_value` of `iteration` exceeds `factor` times the first logged
    loss (`first`: its iteration and value; a positive value only). `factor` 0: off."""
    if not factor or first is None or not first[1] > 0 or not loss_value > factor * first[1]:
        return
    raise LossDivergedError(f"the loss diverged: {loss_value:.4g} at iteration {iteration} is over {factor:g} times "
                            f"the first logged loss ({first[1]:.4g} at iteration {first[0]}); lower --lr, or raise "
                            "--max-loss-growth (0: off)")


def _supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam / AdamW / SGD, or an optimizer that says it reads `found_inf` (compact AdamW)."""
    if getattr(optimizer, "reads_found_inf", False):
        return True
    return bool(optimizer.defaults.get("fused")) and type(optimizer).__name__ in {"Adam", "AdamW", "SGD"}


class NonFiniteGuard:
    """On-device record of non-finite losses / gradients, optionally agreed across ranks before each step.

    `update()` runs just before the optimizer step of every iteration (inside a captured graph too). It counts
    iterations on the device, raises `flag` when this rank's loss (or, when given, a gradient) is not finite and
    keeps the first such iteration in `first_bad`. With `skip`, the flag is all-reduced (MAX) before the step so
    every rank skips together; without it nothing is communicated, and `first_nonfinite()` (a collective, called
    by every rank at the same point, e.g. when the agreed logged loss is not finite) finds the first bad one."""

    def __init__(self, device: torch.device, skip: bool, group: dist.ProcessGroup | None = None) -> None:
        self.skip = skip
        self.group = group
        # Static tensors: a captured graph sees the same addresses on every replay.
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)  # iteration number of the last update
        self.first_bad = torch.full((), math.inf, dtype=torch.float64, device=device)
        self.skipped = torch.zeros((), dtype=torch.float64, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._inf = torch.full((), math.inf, dtype=torch.float64, device=device)
        self._on_device = True

    def prepare(self, optimizer: torch.optim.Optimizer, completed: int = 0) -> None:
        """Decide how a skip is done for this optimizer and set the iteration count (call outside capture)."""
        self._on_device = _supports_found_inf(optimizer)
        self.count.fill_(completed)
        if self.skip and not self._on_device:
            log.info("--skip-nonfinite with a non-fused %s: the skip decision reads one flag on the host per "
                     "iteration", type(optimizer).__name__)

    @property
    def skips_on_device(self) -> bool:
        return self._on_device

    def update(self, loss: torch.Tensor | None, grads: Iterable[torch.Tensor] = ()) -> torch.Tensor:
        """Flag this iteration from this rank's loss (if it has one) and gradients; agree across ranks with skip."""
        self.count.add_(1)
        self.flag.zero_()
        if loss is not None:
            self.flag.copy_(torch.logical_not(torch.isfinite(loss)).any())
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if g is not None:
                by_kind.setdefault((g.device, g.dtype), []).append(g)
        for gs in by_kind.values():
            # Sets flag to 1 where any gradient holds inf/NaN; inv_scale 1 leaves the gradients unchanged.
            torch._amp_foreach_non_finite_check_and_unscale_(gs, self.flag, self._one)
        if self.skip and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        bad = self.flag > 0
        torch.minimum(self.first_bad, torch.where(bad, self.count, self._inf), out=self.first_bad)
        if self.skip:
            self.skipped.add_(bad.to(self.skipped.dtype))
        return self.flag

    def arm(self, optimizer: torch.optim.Optimizer) -> bool:
        """Prepare the coming `optimizer.step()` to skip when the flag is set (call after `update`). Returns False
        when the step must not run at all (host fallback for optimizers without on-device skipping)."""
        if not self.skip:
            return True
        if self._on_device:
            optimizer.found_inf = self.flag  # read by the fused kernels; see torch.optim.adam._fused_adam
            return True
        return self.flag.item() == 0

    def first_nonfinite(self) -> int | None:
        """First iteration any rank flagged (a collective over `group` when distributed; synchronizes)."""
        value = self.first_bad.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        v = float(value)
        return None if math.isinf(v) else int(v)

    def skipped_steps(self) -> int:
        """Steps skipped so far (identical on every rank; synchronizes)."""
        return int(float(self.skipped))
