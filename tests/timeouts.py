"""Test timeouts that grow with the machine's load, and one torch thread per test process (tests/conftest.py).

pytest-timeout's limits catch hangs; a healthy test on a loaded machine only runs longer. Each test's limit (its
`timeout` mark, else the ini's) is multiplied, when the test starts, by `scale()`: PEERLINE_TEST_TIMEOUT_SCALE when
set, else the run queue per core (the 1-minute load average over the cores), at least 1. With one thread per
process, a CPU-bound test at load L on C cores gets about C/L of a core: its time grows by that factor.

torch's CPU kernels use every core through OpenMP, whose threads spin while they wait: on 2 cores shared with other
work a test of 0.5 s took 9.8 s with two threads (the Phi polynomial fit, load 10) and the tiny GPT's 3.2 s took
53 s, so `threads()` is 1 unless OMP_NUM_THREADS says otherwise (or the machine has cores to spare).
"""

from __future__ import annotations

import os

SCALE_VARIABLE = "PEERLINE_TEST_TIMEOUT_SCALE"
MAX_SCALE = 20.0  # a test that hangs still ends


def scale(env: dict[str, str] | None = None, load: float | None = None, cores: int | None = None) -> float:
    """The factor on every test's timeout: PEERLINE_TEST_TIMEOUT_SCALE, else the load per core (at least 1)."""
    env = os.environ if env is None else env
    if env.get(SCALE_VARIABLE):
        value = float(env[SCALE_VARIABLE])
        if not value > 0:
            raise ValueError(f"{SCALE_VARIABLE}={env[SCALE_VARIABLE]!r} is not a positive number")
        return value
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    return min(MAX_SCALE, max(1.0, load / cores))


def threads(env: dict[str, str] | None = None, cores: int | None = None) -> int:
    """torch's threads in a test process: OMP_NUM_THREADS when set, else the cores per xdist worker over 4 (1 on
    a small machine, where the workers and the multi-process jobs already fill the cores)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return int(env["OMP_NUM_THREADS"])
    cores = (os.cpu_count() or 1) if cores is None else cores
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, cores // (4 * workers))


def scaled(timeout: float | None, factor: float) -> float | None:
    """A timeout times the factor; none (or 0: no timeout) stays as it is."""
    return timeout * factor if timeout else timeout


__all__ = ["scale", "threads", "scaled", "SCALE_VARIABLE", "MAX_SCALE"]
