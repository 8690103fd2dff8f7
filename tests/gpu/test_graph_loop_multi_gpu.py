"""--graph-loop on two GPUs: dp=2 (NCCL inside the loop body) and pp=2 over NCCL and over the copy engine, each run
looped (--graph-loop 4) against the same run replaying one iteration per launch (--graph-loop 1): bitwise equal,
and the looped run reports how many iterations each launch ran and why it was not looped.

fp32, 14 iterations logged every 4: 0-1 eager, 2-3 single replays, 4-11 two loops of 4, 12-13 single replays.
NCCL's collectives inside a loop body and the copy engine's flag waits are refused by cudaGraphInstantiate today
(distributed/cudagraph/loop.py), so each of these must fall back to one iteration per launch cleanly; set WANT to 4
for a grid once it loops. CUDA_LOG_FILE=stderr puts the driver's own reason for a refusal into the run's log.
The nomix case is an experiment: NCCL_GRAPH_MIXING_SUPPORT=0 (NCCL captures without its event-based strong streams);
it must match bitwise, its loop state is only reported.
"""

from __future__ import annotations

import pytest

from tests.gpu.compare import Expect, assert_matches
from tests.gpu.jobs import Run

pytestmark = [pytest.mark.gpu, pytest.mark.gpu2, pytest.mark.timeout(600)]

ARGS = ("--hidden", "256", "--layers", "4", "--seq", "64", "--micro-batch-size", "2", "-m", "4", "--iters", "14",
        "--warmup-iters", "2", "--log-every", "4", "--dtype", "fp32")
DRIVER_LOG = (("CUDA_LOG_FILE", "stderr"),)

# case -> (grid flags, dp, iterations per launch the looped run must end with (None: only reported), extra env)
CASES = {
    "dp2": (("--pp", "1", "--dp", "2"), 2, 1, ()),
    "pp2_nccl": (("--pp", "2", "--p2p", "nccl", "--schedule", "1f1b"), 1, 1, ()),
    "pp2_copy_engine": (("--pp", "2", "--p2p", "copy-engine", "--schedule", "1f1b"), 1, 1, ()),
    "dp2_nomix": (("--pp", "1", "--dp", "2"), 2, None, (("NCCL_GRAPH_MIXING_SUPPORT", "0"),)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_looped_equals_one_launch_per_iteration(pipeline_runs, case: str) -> None:
    grid, dp, want, env = CASES[case]
    runs = [Run(f"graph_loop_{case}_{k}", (*ARGS, *grid, "--graph-loop", str(k)), nproc=2, env=(*DRIVER_LOG, *env))
            for k in (4, 1)]
    looped, plain = pipeline_runs.results(*runs)
    print(f"graph_loop {case}: graph {looped['graph']}, iterations per launch {looped['graph_loop']}; "
          f"why not looped: {looped['graph_loop_failed']}")
    assert_matches(looped, plain, Expect(0.0, world=2, dp=dp, graph=True))
    if want is not None:
        assert looped["graph_loop"] == want, f"iterations per launch {looped['graph_loop']}, expected {want}; " \
                                             f"why not looped: {looped['graph_loop_failed']}"
