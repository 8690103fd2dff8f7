"""CPU tests of the GPU tests' harness: the verdicts of tests/gpu/compare.py, the commands and the run cache of
tests/gpu/jobs.py (real launch/pipeline.py runs on the CPU, gloo), that every peerline import of the GPU tests,
workers and probes resolves, and that tools/gpu_checks.sh parses. No GPU needed; not marked gpu."""

from __future__ import annotations

import ast
import copy
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.compare import Expect, bench_problems, run_problems, timeline_problems
from tests.gpu.jobs import PIPELINE, REPO, Run, RunCache, device_of, fault_env
from tests.helpers import TINY

pytestmark = pytest.mark.timeout(300)


def _result(losses: list[float], replicas: int = 1, layers: int = 4) -> dict:
    sums = {f"r{r}/{i}": [0.5 + i, 10.0 + i] for r in range(replicas) for i in range(layers)}
    return {"losses": losses, "layer_checksums": sums, "world_size": replicas, "graph": True,
            "transport": "copy-engine (act->1; depth 4)"}


REF = _result([2.0, 1.5, 1.25])


def test_identical_run_has_no_problems() -> None:
    problems, line = run_problems(copy.deepcopy(REF), REF, Expect(0.0, graph=True, transport="copy-engine"))
    assert problems == [] and "worst relative difference 0" in line


def test_loss_beyond_rtol_is_a_problem_and_within_is_not() -> None:
    got = copy.deepcopy(REF)
    got["losses"][1] *= 1 + 3e-5
    assert run_problems(got, REF, Expect(1e-4))[0] == []
    problems, line = run_problems(got, REF, Expect(1e-5))
    assert len(problems) == 1 and "worst relative difference" in problems[0] and "iteration 2" in line


def test_checksum_beyond_rtol_is_a_problem() -> None:
    got = copy.deepcopy(REF)
    got["layer_checksums"]["r0/3"][1] *= 1 + 1e-3
    problems, line = run_problems(got, REF, Expect(1e-5))
    assert problems and "r0/3" in line


def test_nan_loss_is_a_problem() -> None:
    got = copy.deepcopy(REF)
    got["losses"][2] = math.nan
    assert any("non-finite" in p for p in run_problems(got, REF, Expect(1e-5))[0])


def test_layout_problems_world_replicas_layers_graph_transport() -> None:
    got = _result(REF["losses"], replicas=2)
    assert run_problems(got, REF, Expect(1e-5, world=2, dp=2))[0] == []
    del got["layer_checksums"]["r1/2"]  # a replica that lost a layer
    problems = run_problems(got, REF, Expect(1e-5, world=4, dp=2, graph=False, transport="nccl"))[0]
    joined = "; ".join(problems)
    for what in ("world size 2, expected 4", "r1 has layers", "graph=True, expected False", "transport"):
        assert what in joined, joined
    assert any("replicas" in p for p in run_problems(got, REF, Expect(1e-5, world=2, dp=1))[0])


def test_fewer_losses_is_a_problem() -> None:
    got = copy.deepcopy(REF)
    got["losses"].pop()
    assert any("2 losses vs 3" in p for p in run_problems(got, REF, Expect(1e-5))[0])


def _record(case: str, ratio: float | None = 1.2) -> dict:
    return {"case": case, "ratio": ratio}


def test_bench_problems() -> None:
    cases = [f"{shape} 1f1b {v}" for shape in ("compute-bound", "launch-bound") for v in ("eager", "graph")]
    assert bench_problems([_record(c) for c in cases], ["compute", "launch"], ["eager", "graph"]) == []
    problems = bench_problems([_record(cases[0], math.inf), *map(_record, cases[1:3])], ["compute", "launch"],
                              ["eager", "graph"])
    assert len(problems) == 2 and "non-finite" in problems[0] and "launch-bound 1f1b graph" in problems[1]
    assert bench_problems([], ["compute"], ["eager"])[0] == "no records"


def test_timeline_problems(tmp_path: Path) -> None:
    (tmp_path / "timeline-compute-bound-1f1b.json").write_text("{}")
    (tmp_path / "results.md").write_text("- timeline compute: 12 spans, consistent\n")
    assert timeline_problems(tmp_path, 1) == []
    assert timeline_problems(tmp_path, 2) != []


def test_commands() -> None:
    one = Run("a", ("--iters", "2")).command(Path("x.json"))
    assert one == [sys.executable, str(PIPELINE), "--iters", "2", "--json", "x.json"]
    two = Run("b", ("--pp", "2"), nproc=2).command(Path("y.json"))
    assert two[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in two
    assert two[-4:] == ["--pp", "2", "--json", "y.json"]


def test_device_of_respects_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_of(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [device_of(0), device_of(1)] == ["2", "3"]


def test_fault_env_keeps_a_pair_and_drops_a_hidden_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-spawned GPU ranks keep the pair they were given; an empty list left by a CPU helper does not hide
    the GPUs; the CPU forcing never reaches them."""
    monkeypatch.setenv("PEERLINE_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    env = fault_env("kill:rank=1:iter=6")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PEERLINE_FAULT"] == "kill:rank=1:iter=6"
    assert "PEERLINE_DEVICE" not in env
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES" not in fault_env()


@pytest.fixture
def cpu_runs(tmp_path: Path) -> RunCache:
    """Runs as the GPU tests start them; with no CUDA here they pick the CPU (gloo) themselves."""
    return RunCache(tmp_path, gpus=2)


@pytest.mark.slow
def test_run_cache_on_the_cpu(cpu_runs: RunCache, tmp_path: Path) -> None:
    """Two one-rank runs side by side, a cached repeat, and pp=2 on two ranks against one: what the GPU tests do."""
    ref = Run("ref", tuple(TINY))
    same = Run("same", tuple(TINY), env=(("PEERLINE_TEST_TAG", "1"),))  # another key: runs again
    pp2 = Run("pp2", (*TINY, "--pp", "2"), nproc=2)
    got_ref, got_same, got_pp2 = cpu_runs.results(ref, same, pp2)
    assert run_problems(got_same, got_ref, Expect(0.0, graph=False))[0] == []
    assert run_problems(got_pp2, got_ref, Expect(1e-5, world=2))[0] == []
    assert cpu_runs.results(Run("again", tuple(TINY)))[0] is got_ref  # same command: not run again
    assert not (tmp_path / "again.log").exists()
    assert json.loads((tmp_path / "pp2.json").read_text())["world_size"] == 2


def test_run_cache_reports_failures_and_timeouts(cpu_runs: RunCache) -> None:
    with pytest.raises(pytest.fail.Exception, match="exit status 2"):
        cpu_runs.results(Run("bad", ("--no-such-flag",)))
    with pytest.raises(pytest.fail.Exception, match="exit status 2"):  # remembered, not run again
        cpu_runs.results(Run("bad_again", ("--no-such-flag",)))
    with pytest.raises(pytest.fail.Exception, match="timed out after 0.5 s"):
        cpu_runs.results(Run("slow", (*TINY, "--iters", "100000"), timeout=0.5))


def _peerline_imports(path: Path) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("peerline"):
            found += [(node.module, a.name) for a in node.names]
    return found


def _resolves(module: str, name: str) -> bool:
    if hasattr(importlib.import_module(module), name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("path", sorted([*Path(__file__).parent.glob("**/*.py"),
                                         *(REPO / "tools" / "gpu_probes").glob("*.py")]), ids=lambda p: p.name)
def test_peerline_imports_of_gpu_code_resolve(path: Path) -> None:
    """The GPU tests skip before importing peerline on the CPU: a moved module would go unnoticed until a GPU run."""
    missing = [f"{m}.{n}" for m, n in _peerline_imports(path) if not _resolves(m, n)]
    assert not missing, missing


def test_runner_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(REPO / "tools" / "gpu_checks.sh")]).returncode == 0


def test_failures_are_written_as_they_happen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """conftest's hook appends each failed report's text to $PEERLINE_GPU_OUT/failures.txt (what a run cut by
    gpu_checks.sh's LIMIT still has), and nothing for a passed one."""
    from types import SimpleNamespace

    from tests.gpu import conftest

    monkeypatch.setenv("PEERLINE_GPU_OUT", str(tmp_path / "runs"))
    for nodeid, failed in (("t.py::a", True), ("t.py::b", False), ("t.py::c", True)):
        conftest.pytest_runtest_logreport(SimpleNamespace(
            nodeid=nodeid, when="call", failed=failed, longreprtext=f"AssertionError: {nodeid} {failed}"))
    text = (tmp_path / "runs" / "failures.txt").read_text()
    assert text == ("==== t.py::a (call) FAILED\nAssertionError: t.py::a True\n"
                    "==== t.py::c (call) FAILED\nAssertionError: t.py::c True\n")
