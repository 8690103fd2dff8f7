"""Failure injection for tests: `PEERLINE_FAULT` makes a rank die, stall, slow down or produce NaN on purpose.

Grammar: faults separated by ';', each `kind:key=value:key=value`:

  kill:rank=1:iter=3          rank 1 ends with os._exit(9) just before iteration 3 (no cleanup, like a crash)
  hang:rank=1:iter=3          rank 1 stops before iteration 3 and never continues (the watchdog must end it)
  raise:rank=1:iter=3         rank 1 raises RuntimeError before iteration 3 (an error of the rank's own code; the
                              others wait for it)
  stop:rank=0:iter=3          rank 0 freezes whole (SIGSTOP) before iteration 3: its watchdog, its beats and, on
                              the rank hosting it, the rendezvous store stop too (a lost node, as the others see it)
  delay:rank=0:iter=2:s=1.5   rank 0 sleeps 1.5 s before iteration 2 (a slow rank, not a failure)
  nan:stage=1:iter=2          stage 1 outputs NaN in every microbatch of iteration 2
  slow-save:rank=1:iter=4:s=5 rank 1's write of the checkpoint of iteration 4 sleeps 5 s once its files are written
                              (a slow disk: with --save-async, training goes on meanwhile)
  fail-save:rank=0:iter=4     rank 0's write of the checkpoint of iteration 4 fails (an I/O error) once its files
                              are written
  kill:rank=3:iter=2:at=end   rank 3 dies right after iteration 2, before the end-of-iteration agreement with the
                              others (the preemption check in the store, the loss read): they wait there for it

Keys: `rank=` (global rank) and/or `stage=` select where the fault fires (at least one); `iter=` is the
iteration number, counted from 1 as the progress lines print it (iter=3 fires before the third iteration runs,
after the checkpoint of iteration 2 could have been written); `at=end` moves a kill, hang, raise, stop or delay to
the end of that iteration instead; `s=` the seconds of a delay; `code=` the exit code of a kill (default 9);
`attempt=` the launcher restart count at which it fires (default 0, so that under `torchrun --max-restarts` the
restarted job does not die again at the same place; `attempt=any` fires on every attempt).

A bad specification raises `FaultSpecError` (a ConfigError) with one line naming the bad part; the entry point
prints it and exits 2. So does a fault aimed at a rank the job does not have (`active()` checks the launcher's
world size) or at a stage it does not have (`check_targets`, once the grid is known). The failsafe calls
`before_iteration(rank, stage, it)` and `after_iteration(rank, stage, it)` at each iteration boundary; the engine
passes each stage output of the forward through `poison_output(stage, it, tensor)`; with no faults each costs one
attribute lookup. A NaN fault changes what an iteration computes, so a run with one must not replay a CUDA graph
captured before the fault's iteration: `active().needs_eager()` tells the runtime.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from peerline import overrides
from peerline.distributed.config import ConfigError
from peerline.distributed.env import launch_rank_world

log = logging.getLogger(__name__)

ENV = "PEERLINE_FAULT"
KINDS = ("kill", "hang", "raise", "stop", "delay", "nan", "slow-save", "fail-save")
SAVE_KINDS = ("slow-save", "fail-save")  # iter= names the checkpoint's iteration; they fire inside its write
WHEN = ("start", "end")  # at=: before the iteration (default) or right after it
EXIT_KILLED = 9


class FaultSpecError(ConfigError):
    """PEERLINE_FAULT could not be parsed; one line for the user."""


class FaultRaised(RuntimeError):
    """What a `raise` fault raises: an error of the rank's own code, as a bug in a layer would be."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    iteration: int
    rank: int | None = None
    stage: int | None = None
    seconds: float = 0.0
    code: int = EXIT_KILLED
    attempt: int | None = 0  # None: every attempt
    at: str = "start"  # "end": right after the iteration instead of before it

    def matches(self, rank: int | None, stage: int | None, iteration: int, attempt: int, at: str = "start") -> bool:
        if iteration != self.iteration or at != self.at or (self.attempt is not None and attempt != self.attempt):
            return False
        if self.rank is not None and rank != self.rank:
            return False
        return self.stage is None or stage == self.stage


_ALLOWED = {"kill": {"rank", "stage", "iter", "code", "attempt", "at"},
            "hang": {"rank", "stage", "iter", "attempt", "at"}, "raise": {"rank", "stage", "iter", "attempt", "at"},
            "stop": {"rank", "stage", "iter", "attempt", "at"},
            "delay": {"rank", "stage", "iter", "s", "attempt", "at"}, "nan": {"rank", "stage", "iter", "attempt"},
            "slow-save": {"rank", "iter", "s", "attempt"}, "fail-save": {"rank", "iter", "attempt"}}


def parse_faults(spec: str) -> list[Fault]:
    """Parse a PEERLINE_FAULT string; '' gives no faults."""
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if part:
            faults.append(_parse_one(part))
    return faults


def _parse_one(part: str) -> Fault:
    kind, *pairs = part.split(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"{ENV}: unknown fault kind {kind!r} in {part!r}; choose one of {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise FaultSpecError(f"{ENV}: {pair!r} in {part!r} is not key=value")
        if key not in _ALLOWED[kind]:
            raise FaultSpecError(f"{ENV}: {kind} takes {', '.join(sorted(_ALLOWED[kind]))}; got {key!r} in {part!r}")
        if key in values:
            raise FaultSpecError(f"{ENV}: {key!r} given twice in {part!r}")
        values[key] = value.strip()
    if "iter" not in values:
        raise FaultSpecError(f"{ENV}: {part!r} needs iter=N")
    if "rank" not in values and "stage" not in values:
        raise FaultSpecError(f"{ENV}: {part!r} needs rank=R or stage=S")
    if kind in ("delay", "slow-save") and "s" not in values:
        raise FaultSpecError(f"{ENV}: {part!r} needs s=SECONDS")
    attempt_text = values.get("attempt", "0")
    if values.get("at", "start") not in WHEN:
        raise FaultSpecError(f"{ENV}: at={values['at']!r} in {part!r} must be {' or '.join(WHEN)}")
    return Fault(
        kind=kind,
        iteration=_int(values["iter"], "iter", part, low=1),
        rank=_int(values["rank"], "rank", part) if "rank" in values else None,
        stage=_int(values["stage"], "stage", part) if "stage" in values else None,
        seconds=_seconds(values.get("s", "0"), part),
        code=_int(values.get("code", str(EXIT_KILLED)), "code", part, low=1, high=255),
        attempt=None if attempt_text == "any" else _int(attempt_text, "attempt", part),
        at=values.get("at", "start"),
    )


def _int(text: str, key: str, part: str, low: int = 0, high: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise FaultSpecError(f"{ENV}: {key}={text!r} in {part!r} is not an integer") from None
    if v < low or (high is not None and v > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise FaultSpecError(f"{ENV}: {key}={v} in {part!r} must be {bound}")
    return v


def _seconds(text: str, part: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise FaultSpecError(f"{ENV}: s={text!r} in {part!r} is not a number of seconds") from None
    if not 0 <= v < 86400:
        raise FaultSpecError(f"{ENV}: s={v} in {part!r} must be between 0 and 86400")
    return v


class Faults:
    """The faults of one process, with the hooks the engine calls."""

    def __init__(self, faults: list[Fault], attempt: int = 0) -> None:
        self.faults = faults
        self.attempt = attempt
        self._nan = [f for f in faults if f.kind == "nan"]
        self._boundary = [f for f in faults if f.kind != "nan" and f.kind not in SAVE_KINDS]
        self._save = [f for f in faults if f.kind in SAVE_KINDS]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Faults:
        env = overrides.environment() if environ is None else environ
        attempt_text = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        try:
            attempt = int(attempt_text)
        except ValueError:
            attempt = 0
        return cls(parse_faults(env.get(ENV, "")), attempt)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def needs_eager(self) -> bool:
        """True when a fault changes the computation of one iteration (a captured graph would not show it)."""
        return bool(self._nan)

    def before_iteration(self, rank: int, stage: int | None, it: int) -> None:
        """Fire kill / hang / stop / delay faults due before iteration number `it` (from 1) on this rank."""
        for f in self._boundary:
            if f.matches(rank, stage, it, self.attempt):
                _fire(f, rank, stage, f"before iteration {it}")

    def after_iteration(self, rank: int, stage: int | None, it: int) -> None:
        """Fire the faults due right after iteration number `it` (`at=end`) on this rank."""
        for f in self._boundary:
            if f.matches(rank, stage, it, self.attempt, at="end"):
                _fire(f, rank, stage, f"after iteration {it}")

    def during_save(self, rank: int, iteration: int) -> None:
        """Fire slow-save / fail-save faults of the checkpoint of `iteration` on this rank (its files written)."""
        for f in self._save:
            if not f.matches(rank, None, iteration, self.attempt):
                continue
            if f.kind == "slow-save":
                log.warning("fault injected: rank %d's write of checkpoint %d sleeps %.3g s", rank, iteration,
                            f.seconds)
                time.sleep(f.seconds)
            else:
                raise OSError(errno.EIO, f"fault injected: rank {rank}'s write of checkpoint {iteration} fails")

    def poison_output(self, stage: int, it: int, tensor: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """`tensor`, or a NaN-filled result of it when a nan fault targets this stage at iteration `it`.

        Out of place and through autograd (`tensor * nan`), so the gradient of the stage's input is NaN too, as after a
        real overflow."""
        for f in self._nan:
            if f.matches(rank, stage, it, self.attempt):
                return tensor * float("nan")
        return tensor


def _fire(f: Fault, rank: int, stage: int | None, when: str) -> None:
    """Do what fault `f` says, now ('before iteration 3' / 'after iteration 2' names the moment)."""
    where = f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")
    if f.kind == "delay":
        log.warning("fault injected: %s sleeps %.3g s %s", where, f.seconds, when)
        time.sleep(f.seconds)
    elif f.kind == "kill":
        _say(f"peerline: fault injected: {where} killed {when} (exit {f.code})")
        os._exit(f.code)
    elif f.kind == "hang":
        _say(f"peerline: fault injected: {where} hangs {when}")
        while True:
            time.sleep(3600)
    elif f.kind == "raise":
        raise FaultRaised(f"fault injected: {where} raised {when}")
    elif f.kind == "stop":
        _say(f"peerline: fault injected: {where} stops (SIGSTOP) {when}")
        os.kill(os.getpid(), signal.SIGSTOP)


def _say(line: str) -> None:
    """Write a line to stderr before a hard exit (os._exit skips Python's buffers)."""
    try:
        sys.stderr.flush()
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


_ACTIVE: Faults | None = None


def active() -> Faults:
    """The faults of this process, parsed from PEERLINE_FAULT on first use (FaultSpecError if malformed or aimed at
    a rank beyond the launcher's world size)."""
    global _ACTIVE
    if _ACTIVE is None:
        faults = Faults.from_env()
        check_targets(faults.faults, launch_rank_world()[1])
        _ACTIVE = faults
    return _ACTIVE


def check_targets(faults: list[Fault], world_size: int, n_stages: int | None = None) -> None:
    """Each fault's rank (and stage, when the grid is known) exists in this job: a fault that can never fire is a
    mistake in the test, not a run without faults."""
    for f in faults:
        if f.rank is not None and f.rank >= world_size:
            raise FaultSpecError(f"{ENV}: {f.kind} aims at rank {f.rank}, but the job has {world_size} rank(s) "
                                 f"(0..{world_size - 1})")
        if f.stage is not None and n_stages is not None and f.stage >= n_stages:
            raise FaultSpecError(f"{ENV}: {f.kind} aims at stage {f.stage}, but the pipeline has {n_stages} "
                                 f"stage(s) (0..{n_stages - 1})")


def reset(faults: Faults | None = None) -> None:
    """Replace (or forget, to re-read the environment) the process's faults; for tests."""
    global _ACTIVE
    _ACTIVE = faults


def before_iteration(rank: int, stage: int | None, it: int) -> None:
    """Module-level hook: `active().before_iteration(...)`."""
    faults = active()
    if faults:
        faults.before_iteration(rank, stage, it)


def poison_output(stage: int, it: int, tensor: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """Module-level hook: `active().poison_output(...)`."""
    faults = active()
    return faults.poison_output(stage, it, tensor, rank) if faults else tensor
