"""Top GPU kernels of a `--profile DIR` trace: device time per iteration by kernel name, with totals by class
(GEMM, attention, elementwise / other, copies). INFO lines only.

    python3 tools/gpu_probes/top_kernels.py DIR/rank0 [--iterations 3] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "cudnn_generated")):  # before gemm: flash names cutlass
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "gemm"
    if "nccl" in low:
        return "nccl"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    files = sorted(glob.glob(os.path.join(a.folder, "*.json")))
    if not files:
        raise SystemExit(f"top_kernels: error: no trace JSON in {a.folder}")
    with open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    by_name: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e["name"] if e["cat"] == "kernel" else e["cat"]
            by_name[name] += e.get("dur", 0)
            counts[name] += 1
    per_it = a.iterations * 1000.0  # us -> ms per iteration
    classes: collections.Counter = collections.Counter()
    for name, us in by_name.items():
        classes[kernel_class(name) if not name.startswith("gpu_") else "copies"] += us
    total = sum(by_name.values())
    print(f"INFO {files[-1]}: device time {total / per_it:.2f} ms per iteration; "
          + ", ".join(f"{k} {v / per_it:.2f}" for k, v in classes.most_common()))
    for name, us in by_name.most_common(a.top):
        print(f"INFO {us / per_it:8.2f} ms  x{counts[name] / a.iterations:6.0f}  {name[:150]}")


if __name__ == "__main__":
    main()
