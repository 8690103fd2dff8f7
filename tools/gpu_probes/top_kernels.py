"""Top GPU kernels of a `--profile DIR` trace: device time per iteration by kernel name, with totals by class
(GEMM, attention, elementwise / other, copies). INFO lines only.

    python3 tools/gpu_probes/top_kernels.py DIR/rank0 [--iterations 3] [--top 25] [--host]

--host lists where the host time goes instead: host ops (cpu_op, python_function, cuda_runtime, cuda_driver events;
annotations and device events left out) by self time per iteration, with calls per iteration, and their total.
An op's self time is its duration less its direct children's, nesting by time containment on its own thread.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
from collections.abc import Callable


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "cudnn_generated")):  # before gemm: flash names cutlass
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "gemm"
    if "nccl" in low:
        return "nccl"
    return "other"


HOST_CATS = ("cpu_op", "python_function", "cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(events: list[dict]) -> list[dict]:
    """A chrome trace's kernels, memcpys and memsets."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]


def idle_intervals(events: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """The holes in the union of the device's kernel, memcpy and memset intervals (no stream busy), in time order:
    (start us, end us, the work that ended last before the hole, the work that ends it)."""
    evs = sorted(device_events(events), key=lambda e: e["ts"])
    if not evs:
        return []
    end, last = evs[0]["ts"] + evs[0].get("dur", 0), evs[0]
    holes = []
    for e in evs[1:]:
        if e["ts"] > end:
            holes.append((end, e["ts"], last, e))
        if e["ts"] + e.get("dur", 0) > end:
            end, last = e["ts"] + e.get("dur", 0), e
    return holes


def busy_ms(events: list[dict]) -> float:
    """The union of the device's kernel, memcpy and memset intervals, ms: its span less its idle intervals."""
    dev = device_events(events)
    if not dev:
        return 0.0
    span = max(e["ts"] + e.get("dur", 0) for e in dev) - min(e["ts"] for e in dev)
    return (span - sum(stop - start for start, stop, _, _ in idle_intervals(dev))) / 1000.0


def device_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """(device us by kernel name, launches by name, us by class) of a chrome trace's kernels, memcpys and
    memsets (the last two named by their category, classed as copies)."""
    by_name: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in device_events(events):
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        by_name[name] += e.get("dur", 0)
        counts[name] += 1
    classes: collections.Counter = collections.Counter()
    for name, us in by_name.items():
        classes[kernel_class(name) if not name.startswith("gpu_") else "copies"] += us
    return by_name, counts, classes


def host_self_times(events: list[dict], idle: Callable[[str], bool] | None = None
                    ) -> tuple[collections.Counter, collections.Counter]:
    """(self us by name, calls by name) of the host ops among a chrome trace's events. An event `idle` names (a
    thread's wait, e.g. a threading.py frame) is left out with everything nested in it: a background thread
    waiting on a lock is not host work."""
    threads: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    self_us: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for evs in threads.values():
        stack: list[tuple[dict, bool]] = []  # the open ancestors of the next event, each with: inside an idle one
        for e in sorted(evs, key=lambda e: (e["ts"], -e.get("dur", 0))):
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0].get("dur", 0):
                stack.pop()
            inside_idle = bool(stack and stack[-1][1])
            if stack and not inside_idle:
                self_us[stack[-1][0]["name"]] -= e.get("dur", 0)  # an idle child is not its parent's work either
            skipped = inside_idle or (idle is not None and idle(e["name"]))
            stack.append((e, skipped))
            if skipped:
                continue
            self_us[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    return self_us, calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--host", action="store_true", help="host ops by self time instead of GPU kernels")
    a = p.parse_args(argv)
    files = sorted(glob.glob(os.path.join(a.folder, "*.json")))
    if not files:
        raise SystemExit(f"top_kernels: error: no trace JSON in {a.folder}")
    with open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    per_it = a.iterations * 1000.0  # us -> ms per iteration
    if a.host:
        self_us, calls = host_self_times(events)
        print(f"INFO {files[-1]}: self CPU {sum(self_us.values()) / per_it:.2f} ms per iteration over "
              f"{sum(calls.values()) / a.iterations:.0f} op calls")
        for name, us in self_us.most_common(a.top):
            print(f"INFO host {us / per_it:8.2f} ms  x{calls[name] / a.iterations:6.0f}  {name[:150]}")
        return
    by_name, counts, classes = device_times(events)
    total = sum(by_name.values())
    print(f"INFO {files[-1]}: device time {total / per_it:.2f} ms per iteration; "
          + ", ".join(f"{k} {v / per_it:.2f}" for k, v in classes.most_common()))
    for name, us in by_name.most_common(a.top):
        print(f"INFO {us / per_it:8.2f} ms  x{counts[name] / a.iterations:6.0f}  {name[:150]}")


if __name__ == "__main__":
    main()
