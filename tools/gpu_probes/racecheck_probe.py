"""Ask compute-sanitizer's racecheck which synchronization it follows (kernels in racecheck_probe.cu).

    python tools/gpu_probes/racecheck_probe.py CASE          # one probe kernel, checked; run it under the sanitizer
    python tools/gpu_probes/racecheck_probe.py --all OUTDIR  # every probe under `compute-sanitizer --tool racecheck`

--all prints one line per probe: "INFO kernels.racecheck_probe CASE: N hazards (expected ...)" and a PASS/FAIL line
for the two controls (probe_race must be reported, probe_syncthreads must not), so a tool that reports nothing at
all, or everything, cannot pass for an answer. The tool's full text goes to OUTDIR/racecheck_probe_CASE.txt.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

CASES = ("probe_race", "probe_race_ordered", "probe_syncthreads", "probe_named_all", "probe_named_part",
         "probe_named_part_atomic", "probe_pipelines_partial", "probe_pipelines_whole", "probe_pipelines_partial_w8",
         "probe_pipelines_whole_w8")
# case -> the tool must report a hazard. probe_race (one word, read and write at about the same time) drew no report
# on the first H100 run, so the positive control is the ordered race over 32 words with changed values.
CONTROLS = {"probe_race_ordered": True, "probe_syncthreads": False}
NTILES = 9  # the pipeline probes wrap their 2 stages four times over
SOURCE = Path(__file__).with_name("racecheck_probe.cu")


def run_case(case: str) -> None:
    """Launch one probe kernel (one block: 3 warps, 10 for the _w8 probes) and check what it wrote; raises on a
    wrong result."""
    import cupy

    module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",), backend="nvrtc")
    kernel = module.get_function(case)
    compute_warps = 8 if case.endswith("_w8") else 1
    threads = 32 * (compute_warps + 2)  # loader, compute warps, storer (the controls use the first 64)
    n = NTILES * 128 * compute_warps
    src = cupy.random.randint(-1000, 1000, size=n, dtype=cupy.int32)
    out = cupy.full(n, -(1 << 30), dtype=cupy.int32)  # poisoned
    if case.startswith("probe_pipelines"):
        # two blocks doing the same work, as in the engine's wrap-around case
        kernel((2,), (threads,), (src, out, cupy.int32(NTILES)))
        ok = bool((out == src + 1).all())
    else:
        kernel((1,), (threads,), (out,))
        ok = int(out[0]) == 7
    cupy.cuda.runtime.deviceSynchronize()
    if not ok:
        raise SystemExit(f"{case}: wrong result")
    print(f"{case}: result ok")


def hazards(text: str) -> int | None:
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazard", text)
    return int(m.group(1)) if m else None


def run_all(out_dir: Path) -> int:
    san = shutil.which("compute-sanitizer") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))), None)
    if san is None:
        print("SKIP kernels.racecheck_probe (compute-sanitizer not found)")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for case in CASES:
        cmd = [san, "--tool", "racecheck", "--racecheck-report", "all", "--print-limit", "50",
               sys.executable, __file__, case]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            text = f"timed out: {e}"
        (out_dir / f"racecheck_probe_{case}.txt").write_text(text)
        n = hazards(text)
        ran = f"{case}: result ok" in text
        print(f"INFO kernels.racecheck_probe {case}: {n if n is not None else '?'} hazards"
              f"{'' if ran else ' (kernel result missing: see the file)'}")
        if case in CONTROLS:
            good = ran and n is not None and (n > 0) == CONTROLS[case]
            failed += not good
            print(f"{'PASS' if good else 'FAIL'} kernels.racecheck_probe_control_{case} "
                  f"({n} hazards, {'some' if CONTROLS[case] else 'none'} expected)")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--all":
        return run_all(Path(argv[1]))
    if len(argv) == 1 and argv[0] in CASES:
        run_case(argv[0])
        return 0
    print(f"usage: racecheck_probe.py CASE | --all OUTDIR; cases: {', '.join(CASES)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
