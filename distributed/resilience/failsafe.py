"""Failure behaviour of a run, as an iteration hook: deadlines, clear errors, faults, checkpoints.

  rt = Runtime.create(cfg, hooks=[Failsafe.attach])   # reads --save/--save-every/--resume/--skip-nonfinite from cfg
  rt.train(on_iteration=...)

`attach` (every rank, collectively, before any graph capture):
  - parses PEERLINE_FAULT (a bad spec: one line, exit 2),
  - checks the --save directory is writable and loads --resume (weights, optimizer, RNG, iteration), and agrees
    across ranks that both worked, so no rank starts training while another has failed,
  - plugs in: the engine's exchange observer (exchange_watch.py: tells the watchdog which edge / microbatch / peer
    rank an exchange waits for), a forward hook for injected NaN (and graphs off: the graph policy's `disable`),
    an optimizer pre-step hook for the non-finite guard,
  - starts the watchdog (deadline --timeout-s per iteration) and its SIGTERM reporting.

As a hook: `before_launch` / `after_launch` are the iteration boundary (watchdog, faults, a checkpoint at
--save-every multiples, which also end looped launches: `launch_stops`); `on_logged` checks the loss; `on_train_end`
makes the final checkpoint; `on_error` turns every failure into one line: a non-finite loss (rank 0 prints it,
every rank exits 1 together), a communication error (`watchdog.fail`: names what this rank waited for, so the lost
peer; exit 1), a timeout (the watchdog: exit 3), a user error raised by one rank mid-run (a stage output that
changed shape, a checkpoint that cannot be written: one line, exit 2 at once, since its peers wait for it). User
errors found by `attach` (bad fault spec, unwritable --save, a checkpoint of another run) are agreed by every rank
and propagate to the entry point, which exits 2; the lowest failing rank alone prints the line (the others raise
`ReportedElsewhere`), so an error every rank has alike is one line per job.

Rank 0 says what the checkpoints did, one line each: `peerline: saved checkpoint of iteration N to DIR`, `peerline:
resumed from DIR at iteration N`, and for a run resumed at or past --iters, `peerline: nothing to do: ...`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from peerline import torchrun_report
from peerline.distributed.config import ConfigError, ReportedElsewhere
from peerline.distributed.hooks import IterationHooks, IterationStats
from peerline.distributed.pipeline.placement import placement_for
from peerline.distributed.resilience import checkpoint as ckpt
from peerline.distributed.resilience import checkpoint_store as ckpt_store
from peerline.distributed.resilience import faults as faults_mod
from peerline.distributed.resilience.async_checkpoint import AsyncSaver
from peerline.distributed.resilience.exchange_watch import ExchangeWatch, attach_heartbeat, name_collective_waits
from peerline.distributed.resilience.nonfinite import NonFiniteGuard, NonFiniteLossError, check_finite, check_growth
from peerline.distributed.resilience.oom import is_oom, oom_line, peaks_by_rank
from peerline.distributed.resilience.run_state import RunState
from peerline.distributed.resilience.watchdog import Watchdog
from peerline.distributed.streams import use

log = logging.getLogger(__name__)


class Failsafe(IterationHooks):
    """See the module docstring. The failure options come from `rt.cfg` (validated by RunConfig)."""

    def __init__(self, rt: Any, *, timeout_s: float | None = None, faults: faults_mod.Faults | None = None,
                 signals: bool = True) -> None:
        self.rt = rt
        self.cfg = rt.cfg
        self.save_dir = self.cfg.save
        self.save_every = self.cfg.save_every
        self.resume_dir = self.cfg.resume
        self.skip = self.cfg.skip_nonfinite
        # A launch ends at every checkpoint iteration (a looped graph never runs past one).
        self.launch_stops = (self.save_every,) if self.save_dir and self.save_every else ()
        self.rank = rt.info.rank
        self.world = rt.info.world_size
        self.faults = faults if faults is not None else faults_mod.active()
        engine = rt.engine
        self.stage_ids = list(engine.order)
        self.stage = self.stage_ids[0] if len(self.stage_ids) == 1 else None
        self.holds_last = any(s.is_last for s in engine.stages.values())
        self._peers = _describe_peers(rt.mesh)
        self._peer_ranks = _peer_ranks(rt.mesh)
        self.manifest = ckpt.build_manifest(self.cfg, self.world, pp=rt.mesh.pp)  # the resolved pp
        self.state = RunState(rt)  # what this rank saves and loads, by the whole model's names
        self.watchdog = Watchdog(self.rank, self.stage_ids, timeout_s or self.cfg.timeout_s)
        self.guard = NonFiniteGuard(rt.device, skip=self.skip)
        self.watch = ExchangeWatch(rt.links, self.watchdog)
        self.current = rt.iteration  # number of the iteration running now (from 1); 0 before the first
        self.last_saved: int | None = None
        self.saver: AsyncSaver | None = None  # --save-async: the background writer (made in setup, collectively)
        self.resumed_from = 0  # iterations completed when training (re)started
        self._stash: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._first_loss: tuple[int, float] | None = None  # the first finite logged loss: (iteration, value)
        self._later: list[str] = []  # lines of a launch, said once its progress line is out (_say_held)
        self._signals = signals
        self._installed = False
        self._finished = False  # training ended (or failed) and the watchdog stopped

    # ----------------------------------------------------------------------------------------------------------
    # setup

    @classmethod
    def attach(cls, rt: Any, **kwargs: Any) -> Failsafe:
        """Build, check the save directory, resume, plug in and start the watchdog (all ranks); returns the hook
        for the runtime to call (a `Runtime.create` hook factory)."""
        fs = cls(rt, **kwargs)
        fs.setup()
        return fs

    def setup(self) -> None:
        """Check --save, load --resume (every rank agreeing), plug in, start the watchdog."""
        try:  # every rank checks alike: rank 0 prints the line
            faults_mod.check_targets(self.faults.faults, self.world, self.rt.mesh.pp * self.cfg.stages)
        except ConfigError as exc:
            raise exc if self.rank == 0 else ReportedElsewhere(str(exc)) from None
        if self.save_dir:  # writable, locked, no leftovers; a fresh run refuses a folder of checkpoints
            self._agree(lambda: ckpt_store.prepare_save_dir(self.save_dir, self.rank, bool(self.resume_dir)),
                        "write its checkpoint directory")
            if self.cfg.save_async:
                self.saver = AsyncSaver.create(self.save_dir, self.rank, self.world, self.rt.device, self.manifest,
                                               keep=self.cfg.keep, after_write=self._during_save)
        if self.resume_dir:
            with use(self.rt.engine.main_stream):  # the copies of the loaded state onto the device
                self._agree(self._resume, "load the checkpoint")
            # Said once every rank has loaded (last_saved: the iteration of the checkpoint loaded, if any).
            self._say(f"resumed from {self.resume_dir} at iteration {self.last_saved}" if self.last_saved is not None
                      else f"no checkpoint in {self.resume_dir} yet: starting from iteration 0")
        self.current = self.resumed_from = self.rt.iteration
        if self.resume_dir and self.rt.iteration >= self.cfg.iters:
            self._say(f"nothing to do: the checkpoint in {self.resume_dir} is at iteration {self.rt.iteration} "
                      f">= --iters {self.cfg.iters}")
        with use(self.rt.engine.main_stream):
            self.guard.prepare(self.rt.engine.optimizer, completed=self.rt.iteration)
        self._install()
        if self._signals:
            self.watchdog.install_signal_handlers()
        self.watchdog.start()

    def _agree(self, action: Callable[[], Any], what: str) -> None:
        """Run `action` on every rank; if it failed anywhere, every rank raises, so nobody goes on to wait for a
        rank that has given up. One line per job: the lowest failing rank raises its error (with the other
        failing ranks' differing messages), every other rank `ReportedElsewhere`."""
        error: ConfigError | None = None
        try:
            action()
        except ConfigError as exc:
            error = exc
        if dist.is_initialized() and self.world > 1:
            with use(self.rt.engine.main_stream):  # never the legacy default stream
                messages: list[str | None] = [None] * self.world
                dist.all_gather_object(messages, None if error is None else str(error))
        else:
            messages = [None if error is None else str(error)]
        failed = [r for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if self.rank != failed[0]:
            raise ReportedElsewhere(f"rank {failed[0]} could not {what}: {messages[failed[0]]}")
        others = [f"rank {r}: {messages[r]}" for r in failed[1:] if messages[r] != messages[failed[0]]]
        if not others:
            raise error
        raise type(error)(f"{error}; also {'; '.join(others)}") from None

    def _resume(self) -> None:
        # The newest checkpoint that verifies on every rank (checkpoint_store.py); None: a fresh start, resuming
        # from our own still empty save directory (what a launcher restart's first attempt sees).
        state = ckpt_store.resume(self.resume_dir, self.save_dir, self.rank, self.world,
                                  ckpt.expected_of(self.manifest), self._say, self.state.template)
        if state is None:
            return
        self.rt.iteration = self.state.apply(state, self.cfg.lr, self.manifest, self._say)
        self.last_saved = state.iteration

    def _say(self, line: str) -> None:
        """One line for the user, from rank 0 (every rank does the same)."""
        if self.rank == 0:
            print(f"peerline: {line}", flush=True)

    def _say_held(self) -> None:
        """The lines held back during the last launch (its checkpoint), now that its progress line is out: at the
        next launch, at the end of training or at a failure."""
        for line in self._later:
            self._say(line)
        self._later.clear()

    def _install(self) -> None:
        """Plug into the runtime's explicit slots: the engine's exchange observer, the graph policy, the stage
        modules' forward hooks (injected NaN) and the optimizer's step hooks (the non-finite guard)."""
        if self._installed:
            return
        self._installed = True
        engine = self.rt.engine
        engine.exchange_observer = self.watch
        # At a timeout, the receive the device is stuck on (edge and microbatch) refines the line; the receives
        # the device passes are progress; every rank's beats name the rank that stopped.
        self.watchdog.set_probe(self.watch.describe_stall)
        if self.rt.device.type == "cuda":
            self.watchdog.set_progress_probe(self.watch.passed)
        name_collective_waits(engine, self.watchdog, self.rt.mesh)
        placement = placement_for(self.cfg.schedule, self.rt.mesh.pp, self.cfg.stages)
        attach_heartbeat(self.watchdog, self.rt.mesh, self.rt.device, getattr(self.rt, "info", None),
                         stages_of=placement.stages_of if placement else None)
        if self.faults.needs_eager():
            # The NaN hook decides per iteration on the host; a graph replay would not run it.
            self.rt.graphs.disable("CUDA graph off: PEERLINE_FAULT injects NaN, which needs eager iterations")
            for sid in self.stage_ids:
                engine.stages[sid].module.register_forward_hook(self._poison_hook(sid))
        engine.optimizer.register_step_pre_hook(self._pre_step)
        engine.optimizer.register_step_post_hook(self._post_step)

    def _poison_hook(self, sid: int) -> Callable:
        def hook(_module, _inputs, output):
            return self.faults.poison_output(sid, self.current, output, rank=self.rank)
        return hook

    # ----------------------------------------------------------------------------------------------------------
    # per launch: a looped launch (--graph-loop K) is one boundary for its K iterations: the watchdog sees it as
    # one long iteration, the device-side guard counts each

    def before_launch(self, rt: Any, first_iteration: int, n: int) -> None:
        self._say_held()
        self.before_iteration(first_iteration)

    def after_launch(self, rt: Any, last_iteration: int) -> None:
        self.after_iteration(last_iteration)

    def before_iteration(self, n: int) -> None:
        """Iteration number `n` (from 1) is about to run."""
        self.current = n
        self.watchdog.iteration_started(n)
        self.watch.new_iteration()
        if self.faults:  # before the wait below: a rank hung here waits for nobody
            self.faults.before_iteration(self.rank, self.stage, n)
        # A GPU rank can block inside the iteration (a full launch queue behind a stream waiting on a peer): name
        # the peers from the start, so that timeout too points at the rank that was lost.
        self.watchdog.waiting_for(f"iteration {n} to finish ({self._peers})", ranks=self._peer_ranks)
        with use(self.rt.engine.main_stream):
            # Set, not only counted on the device: graph capture may run the step's hooks more than once.
            self.guard.count.fill_(n - 1)

    def after_iteration(self, n: int) -> None:
        """Iteration `n` has been issued (on a GPU it may still be running)."""
        self.watchdog.iteration_done()
        if self.faults:  # at=end faults: before the agreements that end an iteration (loss read, preemption check)
            self.faults.after_iteration(self.rank, self.stage, n)
        # On a GPU the host has only issued the iteration; what it waits for next is the device, which waits on
        # the peers: name them, so a timeout there still points at the rank that was lost.
        # On the CPU the next waits are the preemption check (a barrier in the store) and the loss read (an
        # all-reduce), both over every rank.
        self.watchdog.waiting_for(f"the device to finish iteration {n} ({self._peers}), or every rank at the end of "
                                  "it (the preemption check, the loss all-reduce)",
                                  ranks=[r for r in range(self.world) if r != self.rank])
        if self.saver is not None and self.saver.in_flight:  # one round: is the background write done everywhere?
            self._written(self.saver.poll())
        if self.save_dir and self.save_every and n % self.save_every == 0:
            self.save(n, held=True)  # said after the iteration's progress line

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.rt.engine.optimizer.param_groups for p in g["params"]]

    def _pre_step(self, optimizer, _args, _kwargs) -> None:
        loss = self.rt.engine.loss_sum if self.holds_last else None
        grads = [p.grad for p in self._params()] if self.skip else ()
        self.guard.update(loss, grads)
        if not self.guard.arm(optimizer):
            # Host fallback (optimizers without on-device skipping): no gradients, no update, no step count.
            self._stash = [(p, p.grad) for p in self._params()]
            for p, _ in self._stash:
                p.grad = None

    def _post_step(self, _optimizer, _args, _kwargs) -> None:
        for p, g in self._stash:
            p.grad = g  # put back the (bucket-view) gradients the step skipped
        self._stash = []

    # ----------------------------------------------------------------------------------------------------------
    # checkpoints

    def _finite_so_far(self) -> None:
        """Collective: raise on every rank if any iteration so far was non-finite (and not skipped)."""
        if self.skip:
            return
        with use(self.rt.engine.main_stream):
            bad = self.guard.first_nonfinite()
        if bad is not None:
            raise NonFiniteLossError(f"non-finite loss at iteration {bad}; rerun with --skip-nonfinite to skip "
                                     "such steps")

    def save(self, n: int, held: bool = False, background: bool | None = None) -> None:
        """Checkpoint after iteration `n` (every rank, collectively); `held`: its line waits for _say_held.
        `background` (default: --save-async) stages it and writes it on the writer's thread; a write still in
        flight is waited for first."""
        self.wait_for_save()
        self._finite_so_far()  # never write a checkpoint of NaN weights
        engine = self.rt.engine
        if self.saver is not None and background is not False:
            with self.watchdog.suspended(), use(engine.main_stream):  # staging: the first one pins its buffers
                if self.rt.device.type == "cuda":
                    torch.cuda.synchronize(self.rt.device)  # the iteration's last writes, on every stream
                self.saver.start(n, self.state.tensors())
            return
        barrier = gather = None
        if dist.is_initialized() and self.world > 1:
            def barrier() -> None:
                # Writing is exempt from the deadline, waiting for the other ranks is not.
                self.watchdog.waiting_for(f"the other ranks to finish writing the checkpoint of iteration {n}",
                                          ranks=[r for r in range(self.world) if r != self.rank])
                self.watchdog.arm()
                dist.barrier()

            def gather(obj: object) -> list:
                everyone: list = [None] * self.world
                dist.all_gather_object(everyone, obj)
                return everyone
        with self.watchdog.suspended(), use(engine.main_stream):
            if self.rt.device.type == "cuda":
                torch.cuda.synchronize(self.rt.device)
            ckpt.save_checkpoint(self.save_dir, self.rank, n, self.state.tensors(), self.manifest, barrier=barrier,
                                 gather=gather, after_write=lambda: self._during_save(n))
            if self.rank == 0:
                ckpt_store.prune(self.save_dir, self.cfg.keep)  # --keep N: the newest N stay
        self.last_saved = n
        line = f"saved checkpoint of iteration {n} to {self.save_dir}"
        if held:
            self._later.append(line)
        else:
            self._say(line)

    def _during_save(self, n: int) -> None:
        """Inside this rank's write of checkpoint `n`, its files written: injected slow or failing disks."""
        if self.faults:
            self.faults.during_save(self.rank, n)

    def wait_for_save(self) -> None:
        """Wait for the background write in flight, if any, on every rank (collectively; one line when long)."""
        if self.saver is None or not self.saver.in_flight:
            return
        with self.watchdog.suspended():  # writing is exempt from the deadline; a round waits the store's timeout
            self._written(self.saver.wait(self._say))

    def _written(self, n: int | None) -> None:
        """The background write of checkpoint `n` is complete on every rank (None: not yet)."""
        if n is not None:
            self.last_saved = n
            self._later.append(f"saved checkpoint of iteration {n} to {self.save_dir}")

    # ----------------------------------------------------------------------------------------------------------
    # the run

    def on_logged(self, rt: Any, stats: IterationStats) -> None:
        """A non-finite logged loss stops every rank (or, with --skip-nonfinite, is logged as skipped); so does one
        past --max-loss-growth times the first (the loss is agreed: every rank raises alike)."""
        if math.isfinite(stats.loss):
            self._first_loss = self._first_loss or (stats.iteration, stats.loss)
            check_growth(stats.loss, stats.iteration, self._first_loss, self.cfg.max_loss_growth)
            return
        # The logged loss is agreed across ranks, so every rank gets here together: the collective in
        # first_nonfinite() is safe, and check_finite raises (or logs the skip) on every rank alike.
        with use(self.rt.engine.main_stream):
            first = None if self.skip else self.guard.first_nonfinite()
        check_finite(stats.loss, stats.iteration, self.skip, first_bad=first)

    def on_train_end(self, rt: Any) -> None:
        """Final checks: no non-finite iteration so far, the last checkpoint, the count of skipped steps. What
        raises here reaches `on_error` like a failure of the loop."""
        self._say_held()
        self._finite_so_far()
        self.wait_for_save()
        self._say_held()
        if self.save_dir and self.last_saved != self.rt.iteration and self.rt.iteration > 0:
            self.save(self.rt.iteration, background=False)
        if self.skip:
            with use(self.rt.engine.main_stream):
                n = self.guard.skipped_steps()
            if n:
                log.warning("%d step(s) skipped for non-finite loss", n)
        self.close()

    def on_error(self, rt: Any, exc: BaseException) -> None:
        """One line per failure, and the exit code of its kind (see the module docstring)."""
        if self._finished:
            return  # raised after this hook's work was done (by another hook): not a training failure
        self._say_held()  # a checkpoint written before the failure
        try:
            if isinstance(exc, NonFiniteLossError):
                # Every rank raises at the same point (the loss and the flags are agreed); one line, from rank 0.
                # A hard exit, like every other failure here: a teardown of captured NCCL communicators could
                # still hang.
                if self.rank == 0:
                    os.write(2, f"peerline: error: {exc}\n".encode())
                    torchrun_report.write_error_file(f"peerline: error: {exc}", 1)
                self.watchdog.fatal_quiet(1)
                raise SystemExit(1) from None
            if isinstance(exc, ReportedElsewhere):  # an error every rank has alike (a failed background write)
                self.watchdog.fatal_quiet(2)  # rank 0 prints its line
            elif isinstance(exc, ConfigError):
                # Raised by one rank in the middle of training (a stage output that changed shape, a checkpoint
                # that could not be written): the others are waiting for it, so a clean shutdown could hang. One
                # line, exit 2, now; the others end by their own error or deadline.
                self.watchdog.fatal(str(exc), 2)
            elif is_oom(exc):  # one line: the rank, what it allocated, every rank's peak, the flags that help
                during = f"iteration {self.current} ({self.watchdog.description()})"
                peaks = peaks_by_rank(self.watchdog, self.rank, self.rt.device)
                self.watchdog.fatal(oom_line(exc, self.watchdog.who, during, peaks, self.cfg), 1)
            elif isinstance(exc, Exception):  # a communication failure: one line naming the wait, exit 1
                self.watchdog.fail(exc)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the watchdog (training is over)."""
        self._finished = True
        self.watchdog.stop()
        writing = self.saver is not None and self.saver.in_flight  # a failure: the process ends with its write
        if self.saver is not None and not writing:
            self.saver.close()
        if self.save_dir and self.rank == 0 and not writing:
            ckpt_store.release_lock(self.save_dir)


def _peer_ranks(mesh: Any) -> list[int]:
    """The ranks this rank's iteration waits on: its pipeline neighbours and its replicas."""
    near = [r for r in (mesh.prev_rank, mesh.next_rank) if r is not None]
    return sorted(set(near) | {r for r in mesh.dp_ranks(mesh.stage) if r != mesh.rank})


def _describe_peers(mesh: Any) -> str:
    """'peers: rank 1 (stage 1), rank 2 (replica 1)': the ranks this rank's iteration waits on."""
    peers = []
    for r in (mesh.prev_rank, mesh.next_rank):
        if r is not None:
            peers.append(f"rank {r} (stage {r % mesh.pp})")
    for r in mesh.dp_ranks(mesh.stage):
        if r != mesh.rank:
            peers.append(f"rank {r} (replica {r // mesh.pp})")
    return "peers: " + ", ".join(peers) if peers else "no peers"
