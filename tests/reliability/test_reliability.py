"""The reliability suite: the table of tests/reliability/cases.py run concurrently, each outcome classified
(clean / traceback / hang / silent wrong / misnamed / data lost); prints the counts and asserts every case clean.
PEERLINE_RELIABILITY_CASES selects some of the cases (see cases.py)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.forkjob import split_command
from tests.reliability.cases import OUTCOMES, all_cases, run_case, write_models

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

WORKERS = 4  # jobs at once: most of a case is waiting (imports, rendezvous, deadlines), not computing


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_every_case_ends_cleanly(tmp_path):
    write_models(tmp_path)
    # The long cases first (real launchers, then injected faults), so that no long one starts last and runs alone.
    cases = sorted(all_cases(tmp_path), key=lambda c: (split_command(c.cmd) is not None, "PEERLINE_FAULT" not in c.env))
    with ThreadPoolExecutor(WORKERS) as pool:
        outcomes = list(pool.map(lambda c: run_case(c, tmp_path), cases))
    counts = {k: sum(1 for o, _ in outcomes if o == k) for k in OUTCOMES}
    print(f"\nreliability: tried {len(cases)} / " + " / ".join(f"{k} {v}" for k, v in counts.items()))
    bad = [(c.name, o, r.errors[:3] or r.out[-600:]) for c, (o, r) in zip(cases, outcomes) if o != "clean"]
    for name, outcome, detail in bad:
        print(f"  {outcome}: {name}: {detail}")
    assert not bad, f"{len(bad)} of {len(cases)} cases not clean: {[b[:2] for b in bad]}"
