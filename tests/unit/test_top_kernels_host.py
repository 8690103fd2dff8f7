"""tools/gpu_probes/top_kernels.py --host on a synthetic trace: host ops by self time (duration less direct
children, nesting per thread), with calls; annotations and device events are left out."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

PROBES = Path(__file__).resolve().parents[2] / "tools" / "gpu_probes"
T0 = 1_700_000_000_000.0  # kineto's timestamps are absolute microseconds


@pytest.fixture(scope="module")
def top_kernels() -> ModuleType:
    sys.path.insert(0, str(PROBES))
    try:
        return importlib.import_module("top_kernels")
    finally:
        sys.path.remove(str(PROBES))


def ev(cat: str, name: str, ts: int, dur: int, tid: int = 1, pid: int = 100) -> dict:
    """A complete event; times in units of 100 us."""
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts * 100, "dur": dur * 100}


EVENTS = [
    ev("user_annotation", "ProfilerStep#1", 0, 500),
    ev("gpu_user_annotation", "ProfilerStep#1", 0, 500, pid=0, tid=7),
    ev("kernel", "ampere_sgemm_128x64_tn", 25, 300, pid=0, tid=7),
    {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": T0 + 2500, "bp": "e"},
    # main thread
    ev("cpu_op", "aten::linear", 0, 100),
    ev("cpu_op", "aten::matmul", 10, 60),
    ev("cuda_runtime", "cudaLaunchKernel", 20, 15),
    ev("cuda_runtime", "cudaLaunchKernel", 40, 10),
    ev("cpu_op", "aten::add", 80, 10),
    ev("cpu_op", "aten::linear", 200, 50),
    ev("cpu_op", "aten::matmul", 210, 30),
    ev("cuda_runtime", "cudaLaunchKernel", 215, 5),
    ev("cuda_runtime", "cudaLaunchKernel", 230, 4),
    ev("cpu_op", "aten::_to_copy", 300, 12),  # listed before its parent of the same start
    ev("cpu_op", "aten::to", 300, 20),
    # the autograd thread, overlapping the main thread's ops in time
    ev("cpu_op", "LayerNormFunctionBackward", 50, 40, tid=2),
    ev("cpu_op", "aten::add", 55, 8, tid=2),
    ev("cuda_driver", "cuLaunchKernel", 70, 6, tid=2),
    ev("cuda_runtime", "cudaStreamSynchronize", 100, 10, tid=2),
]
SELF = {"aten::matmul": 5600, "aten::linear": 5000, "cudaLaunchKernel": 3400, "LayerNormFunctionBackward": 2600,
        "aten::add": 1800, "aten::_to_copy": 1200, "cudaStreamSynchronize": 1000, "aten::to": 800,
        "cuLaunchKernel": 600}
CALLS = {"aten::matmul": 2, "aten::linear": 2, "cudaLaunchKernel": 4, "LayerNormFunctionBackward": 1,
         "aten::add": 2, "aten::_to_copy": 1, "cudaStreamSynchronize": 1, "aten::to": 1, "cuLaunchKernel": 1}


def test_self_times_and_calls(top_kernels: ModuleType) -> None:
    self_us, calls = top_kernels.host_self_times(EVENTS)
    assert dict(self_us) == SELF
    assert dict(calls) == CALLS


def test_host_summary_per_iteration(top_kernels: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rank = tmp_path / "rank0"
    rank.mkdir()
    (rank / "rank0.1700000000000.pt.trace.json").write_text(json.dumps({"traceEvents": EVENTS}))
    top_kernels.main([str(rank), "--host", "--iterations", "2", "--top", "3"])
    out = capsys.readouterr().out
    assert re.search(r"^INFO .*rank0\.1700000000000\.pt\.trace\.json: self CPU 11\.00 ms per iteration over 8 op "
                     r"calls$", out, re.M), out  # the durations' sum would be 19.00 ms
    rows = re.findall(r"^INFO host +([\d.]+) ms  x +(\d+)  (.+)$", out, re.M)
    assert rows == [("2.80", "1", "aten::matmul"), ("2.50", "1", "aten::linear"), ("1.70", "2", "cudaLaunchKernel")]


def test_idle_waits_left_out(top_kernels: ModuleType) -> None:
    """A background thread's wait (a threading.py frame and the lock acquire in it) counts neither as its own
    time nor as its caller's; without `idle` it is host time like any other."""
    waits = [
        ev("python_function", "watchdog.py(130): _run", 0, 100, tid=3),
        ev("python_function", "threading.py(655): wait", 5, 90, tid=3),
        ev("python_function", "<built-in method acquire of _thread.lock object>", 6, 88, tid=3),
        ev("cpu_op", "aten::add", 96, 2, tid=3),
    ]
    self_us, calls = top_kernels.host_self_times(waits, lambda name: "threading.py" in name)
    assert dict(self_us) == {"watchdog.py(130): _run": 800, "aten::add": 200}
    assert dict(calls) == {"watchdog.py(130): _run": 1, "aten::add": 1}
    every, _ = top_kernels.host_self_times(waits)
    assert every["<built-in method acquire of _thread.lock object>"] == 8800 and every["threading.py(655): wait"] == 200


def test_idle_intervals_are_holes_in_every_stream_at_once(top_kernels: ModuleType) -> None:
    """Two streams: a gap on one while the other runs is not idle; the holes in their union are, each with the work
    on either side, and busy time is the span less the holes. Host events are left out."""
    trace = [ev("kernel", "a", 0, 10, tid=7), ev("kernel", "b", 5, 20, tid=8), ev("gpu_memcpy", "c", 30, 5, tid=7),
             ev("cpu_op", "host", 26, 3), ev("kernel", "d", 40, 2, tid=8), ev("gpu_memset", "e", 41, 4, tid=7)]
    holes = top_kernels.idle_intervals(trace)
    assert [(round((a - T0) / 100), round((b - T0) / 100), x["name"], y["name"]) for a, b, x, y in holes] == [
        (25, 30, "b", "c"), (35, 40, "c", "d")]
    assert top_kernels.busy_ms(trace) == pytest.approx((45 - 10) * 0.1)
    assert top_kernels.idle_intervals([ev("cpu_op", "host", 0, 1)]) == [] and top_kernels.busy_ms([]) == 0.0
