"""A model of the bulk loader's hand-off (ws_pipeline.cuh, PL_LOADER 1), run under random interleavings on the CPU.

mbarrier semantics as PTX defines them: a phase completes when its pending arrivals reach 0 and its transaction
count is 0; then the phase number advances and the arrival count resets; try_wait.parity(p) succeeds once the phase
of parity p has completed, i.e. while the current phase's parity differs from p. The TMA copy is an asynchronous
event that lands (writes the stage, completes its bytes) at a random later step. The model follows the kernel
line by line: the loader's lane 0 waits empty[s] with parity (round - 1) & 1 from round 1 on, arrive.expect_tx on
full[s], issues the copies; each compute thread waits full[s] with parity round & 1, reads the stage, arrives on
empty[s]. Checked: every compute thread reads each of its tiles with the right contents, and no copy overwrites a
stage that a compute thread has not released (the wrap-around a missing or wrong-parity wait would allow).
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.timeout(60)


class MBarrier:
    def __init__(self, count: int) -> None:
        self.count = count
        self.pending = count
        self.tx = 0
        self.phase = 0

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx: int = 0) -> None:
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0
        self._maybe_complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def try_wait_parity(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def run(stages: int, consumers: int, ntiles: int, seed: int, wrong_parity: bool = False) -> None:
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(consumers) for _ in range(stages)]
    buf: list[int | None] = [None] * stages  # tile id held by each stage
    readers = [set() for _ in range(stages)]  # consumers that waited on the stage and have not released it
    in_flight: list[tuple[int, int]] = []  # (stage, tile) copies issued, not yet landed

    def loader():
        stage, rnd = 0, 0
        for t in range(ntiles):
            if rnd > 0:
                parity = (rnd - 1) & 1
                if wrong_parity:
                    parity ^= 1
                while not empty[stage].try_wait_parity(parity):
                    yield
            full[stage].arrive(expect_tx=2)  # two operand tiles of 1 "byte" each
            in_flight.append((stage, t))
            yield
            stage += 1
            if stage == stages:
                stage, rnd = 0, rnd + 1

    def consumer(c: int):
        stage, phase = 0, 0
        for t in range(ntiles):
            while not full[stage].try_wait_parity(phase):
                yield
            assert buf[stage] == t, f"consumer {c} read tile {buf[stage]} in stage {stage}, expected {t}"
            readers[stage].add(c)
            yield  # the reads take a while
            readers[stage].discard(c)
            empty[stage].arrive()
            stage += 1
            if stage == stages:
                stage, phase = 0, phase ^ 1

    def tma():
        while True:
            if in_flight and rng.random() < 0.5:
                stage, t = in_flight.pop(0)
                assert not readers[stage], f"tile {t} overwrote stage {stage} while {readers[stage]} read it"
                buf[stage] = t
                full[stage].complete_tx(1)
                yield
                full[stage].complete_tx(1)
            yield

    actors = [loader(), *(consumer(c) for c in range(consumers))]
    copier = tma()
    done = [False] * len(actors)
    for _ in range(200_000):
        if all(done):
            break
        i = rng.randrange(len(actors) + 1)
        if i == len(actors):
            next(copier)
        elif not done[i]:
            try:
                next(actors[i])
            except StopIteration:
                done[i] = True
    assert all(done), "deadlock"


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(8))
def test_bulk_handoff_is_ordered(stages: int, seed: int) -> None:
    run(stages, consumers=3, ntiles=25, seed=seed)


def test_model_catches_a_wrong_parity() -> None:
    """With the loader's empty-wait parity flipped, some interleaving overwrites a stage still being read (or
    deadlocks): the model can fail."""
    failures = 0
    for seed in range(20):
        try:
            run(2, consumers=3, ntiles=25, seed=seed, wrong_parity=True)
        except AssertionError:
            failures += 1
    assert failures > 0
