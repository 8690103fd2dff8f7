#!/usr/bin/env bash
# Warp-specialized elementwise kernels (issue 3) on the GPU machine: (a) correctness tests against float64, (b) the
# SASS report (LDGSTS, registers, shared memory), (c) the launch-shape sweep, (d) the kernels benchmark with the
# default plan and the multi-stream batch driver, (e) compute-sanitizer memcheck + racecheck on small sizes.
# Usage: bash tests/gpu/run_kernels.sh [OUT]   (or OUT=... in the environment)
#   KERNELS_SELECT=tests,sass,sweep,bench,probe,sanitize (comma list; default all; "tests" includes the SASS
#     report; "probe": which synchronization racecheck follows, tests/gpu/racecheck_probe.py)
#   KERNELS_SWEEP_ARGS="..." extra arguments for the sweep, e.g. --sweep-cases residual_add,fwd/fp32 (substrings
#     of case names, '/' for a space), --sweep-plans "w8.s4.d1.l1@res,w16.s3.d1@fwd+bwd" (plans; '@' restricts to op kinds fwd|bwd|res),
#     --sweep-budget 60 (seconds of plans; the step's cap is KERNELS_SWEEP_CAP, default 80)
#   KERNELS_TESTS_CAP   seconds for the float64-referenced pytest step (default 110: 9 extra launch plans compile first)
#   KERNELS_TESTS_K     a pytest -k expression to run part of them (e.g. size_classes)
#   KERNELS_BENCH_VARIANTS=fp32|all|none  bench variants timed next to the default (default fp32: normcdff fp32 GELU)
#   KERNELS_BENCH_PLANS_FROM_SWEEP=1: the bench uses the sweep's SWEEP TUNED_PLANS of the same run
#   KERNELS_RACECHECK_PLANS="w8.s2 w8.s2.d1" (space list): one more racecheck run per plan after the sanitizer step
#   KERNELS_BENCH_SIZES (MiB list, default 16,256: where the goals bind; the issue's full list is 1,16,256,1024) and
#     KERNELS_BENCH_CAP (seconds, default 35)
# Logs to $OUT/kernels.log; SASS report under $OUT/kernels_sass/, bench results under $OUT/bench_kernels/, the
# sweep under $OUT/kernels_sweep/ (sweep.jsonl), full sanitizer text in $OUT/kernels_sanitize_{memcheck,racecheck}.txt.
# Prints one PASS/FAIL/SKIP line per check, the bench's GOAL lines and the sweep's SWEEP lines; exits 0.
# Bounded to about 230 s in all, 210 s without the sanitizer (each step under `timeout`; the bench writes its table after each size and the
# sweep one jsonl row per plan, so a cut run keeps what it finished). First H200 run: pytest 29 s.
. "$(dirname "$0")/common.sh" kernels "${1:-}"

SELECT=",${KERNELS_SELECT:-tests,sass,sweep,bench,probe,sanitize},"
selected() { case "$SELECT" in *",$1,"*) return 0 ;; esac; [ "$1" = sass ] && case "$SELECT" in *",tests,"*) return 0 ;; esac; return 1; }

need_gpus 1 kernels

if selected tests; then
  echo "== correctness (pytest, float64 references)" >> "$LOG"
  step "$OUT/kernels_tests.out" "${KERNELS_TESTS_CAP:-110}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE \
    ${KERNELS_TESTS_K:+-k "$KERNELS_TESTS_K"} tests/gpu/test_kernels_elementwise.py
  rc=$?
  report tests "$rc" "$(tail -n 1 "$OUT/kernels_tests.out" | tr -d '=' | sed 's/^ *//; s/ *$//')"
fi

if selected sass; then
  echo "== SASS report (nvcc -cubin + cuobjdump)" >> "$LOG"
  ARCH="$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'sm_{a}{b}')" 2>>"$LOG")"
  step "$OUT/kernels_sass.out" 20 "$PY" -m peerline.bench.kernel_tools.inspect_sass --arch "${ARCH:-sm_90}" \
    --out "$OUT/kernels_sass"
  rc=$?
  sed 's/^/  /' "$OUT/kernels_sass.out" | grep -E "PASS|FAIL|error" || true
  report sass_ldgsts "$rc"
fi

if selected sweep; then
  # 50 s of plans (compiles included: they run in parallel processes first); the default plan is always timed.
  # KERNELS_SWEEP_ARGS is split on spaces on purpose (a flag list); a later --sweep-budget wins over this one.
  echo "== sweep: launch plans per op (correctness first, then GB/s vs torch and d2d copy)" >> "$LOG"
  # shellcheck disable=SC2086
  step "$OUT/kernels_sweep.out" "${KERNELS_SWEEP_CAP:-80}" "$PY" -m peerline.bench.suites.kernels --sweep \
    --sweep-budget 50 --out "$OUT/kernels_sweep" ${KERNELS_SWEEP_ARGS:-}
  rc=$?
  if ! grep -E "^SWEEP " "$OUT/kernels_sweep.out"; then
    # cut short: summarize the rows it wrote
    if [ -s "$OUT/kernels_sweep/sweep.jsonl" ]; then
      timeout -k 2 10 "$PY" -m peerline.bench.kernel_tools.sweep --summarize "$OUT/kernels_sweep/sweep.jsonl" 2>>"$LOG"
    else
      echo "  (no SWEEP lines: see $LOG)"
    fi
  fi
  report sweep "$rc" "$(grep -c '"status": "ok"' "$OUT/kernels_sweep/sweep.jsonl" 2>/dev/null || echo 0) plan timings"
fi

if selected bench; then
  echo "== bench: kernels (default plan; peerline vs torch eager vs d2d copy)" >> "$LOG"
  # 16 and 256 MiB: where the goals are (the suite's default sizes add 1 and 1024); the launch shapes are the
  # sweep's job. Variants: only fp32 bias+GELU with normcdff (the path before phi_cdf_acc) at 256 MiB, in the same
  # run as the default (KERNELS_BENCH_VARIANTS=all adds the bf16 ones, =none skips them).
  case "${KERNELS_BENCH_VARIANTS:-fp32}" in
    none) variants=(--no-variants) ;;
    *) variants=(--variant-set "${KERNELS_BENCH_VARIANTS:-fp32}") ;;
  esac
  # KERNELS_BENCH_PLANS_FROM_SWEEP=1: the bench runs this run's SWEEP TUNED_PLANS (PEERLINE_KERNEL_PLANS, on top of
  # the tuned plans), so a sweep and a fresh measurement of its choice fit in one call
  if [ "${KERNELS_BENCH_PLANS_FROM_SWEEP:-0}" = 1 ] && [ -s "$OUT/kernels_sweep.out" ]; then
    chosen="$(grep -m1 -E "^SWEEP TUNED_PLANS = " "$OUT/kernels_sweep.out" | cut -d'"' -f2)"
    [ -n "$chosen" ] && export PEERLINE_KERNEL_PLANS="$chosen" && echo "INFO kernels.bench plans from the sweep: $chosen"
  fi
  step "$OUT/bench_kernels.out" "${KERNELS_BENCH_CAP:-35}" "$PY" -m peerline.bench.suites.kernels \
    --out "$OUT/bench_kernels" --sizes-mib "${KERNELS_BENCH_SIZES:-16,256}" "${variants[@]}"
  rc=$?
  grep -E "^GOAL " "$OUT/bench_kernels.out" || echo "  (no GOAL lines: see $LOG)"
  report bench_kernels "$rc"

  echo "== bench: batch_streams (multi-stream batch driver)" >> "$LOG"
  step "$OUT/bench_batch_streams.out" 12 "$PY" -m peerline.bench.suites.batch_streams --out "$OUT/bench_kernels"
  rc=$?
  report bench_batch_streams "$rc"
fi

# What racecheck follows (tests/gpu/racecheck_probe.cu): controls with and without a race, named barriers over all
# or part of a block, and the engine's two cuda::pipelines made over partial and over whole-block groups. One INFO
# line per probe; the two controls PASS or FAIL (a tool that reports everything or nothing answers nothing).
if selected probe; then
  echo "== racecheck probes" >> "$LOG"
  step "$OUT/kernels_racecheck_probe.out" "${KERNELS_PROBE_CAP:-120}" "$PY" tests/gpu/racecheck_probe.py --all \
    "$OUT/racecheck_probe"
  grep -E "^(INFO|PASS|FAIL|SKIP)" "$OUT/kernels_racecheck_probe.out" || echo "FAIL kernels.racecheck_probe (no output, see $LOG)"
fi

# compute-sanitizer over small launches of every path, for the default and the direct-store engine. The full tool
# output goes to its own file under $OUT, so the hazards can be read next time.
if selected sanitize; then
  SAN="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  if [ -z "$SAN" ]; then
    echo "SKIP kernels.sanitize (compute-sanitizer not found)"
  else
    # -lineinfo builds: hazards are reported with lines of the pasted source, written next to the log
    export PEERLINE_KERNEL_LINEINFO=1
    "$PY" -c "from peerline.kernels import compile as kc; print(kc.source_text(), end='')" \
      > "$OUT/kernels_source_for_lineinfo.cu" 2>>"$LOG"
    # compile outside the sanitizer (CuPy's disk cache), so its budget goes to the launches
    echo "== sanitizer warm-up (compile only)" >> "$LOG"
    timeout -k 5 25 "$PY" tests/gpu/kernels_sanitize.py --warm >> "$LOG" 2>&1
    report sanitize_warmup $?
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool (full text: $OUT/kernels_sanitize_$tool.txt)" >> "$LOG"
      # only our kernels (pl_main, pl_scalar, pl_reduce; extern "C" names) are instrumented: torch's own launches
      # (randn, references) run at full speed; memcheck without torch's caching allocator, so a write past an
      # output's end lands outside any allocation instead of inside a cached segment
      opts=(--tool "$tool" --error-exitcode 3 --print-limit 200 --kernel-name kns=pl_)
      [ "$tool" = racecheck ] && opts+=(--racecheck-report all)
      # (torch reads PYTORCH_NO_CUDA_MEMORY_CACHING by presence, so racecheck runs without it, not with "0")
      envs=(); limit=45
      [ "$tool" = memcheck ] && { envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1); limit=35; }
      env "${envs[@]}" timeout -k 5 "$limit" "$SAN" "${opts[@]}" "$PY" tests/gpu/kernels_sanitize.py \
        > "$OUT/kernels_sanitize_$tool.txt" 2>&1
      rc=$?
      tail -n 40 "$OUT/kernels_sanitize_$tool.txt" >> "$LOG"
      summary="$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|kernels_sanitize:" "$OUT/kernels_sanitize_$tool.txt" | tr '\n' ' ' | sed 's/=//g; s/  */ /g')"
      [ "$rc" -eq 124 ] && summary="timed out after ${limit} s; $summary"
      report "sanitize_$tool" "$rc" "$summary"
    done
    # KERNELS_RACECHECK_PLANS="w8.s2 w1.s2 ...": racecheck once more per plan, one INFO line each (hazards per plan),
    # to bisect a report down to the loader / store path that draws it. Full text: $OUT/racecheck_plan_PLAN.txt.
    for p in ${KERNELS_RACECHECK_PLANS:-}; do
      timeout -k 5 25 "$PY" tests/gpu/kernels_sanitize.py --warm --plans "$p" >> "$LOG" 2>&1
      timeout -k 5 45 "$SAN" --tool racecheck --racecheck-report all --print-limit 20 --kernel-name kns=pl_ \
        "$PY" tests/gpu/kernels_sanitize.py --plans "$p" > "$OUT/racecheck_plan_$p.txt" 2>&1
      echo "INFO kernels.racecheck_plan $p (rc $?): $(grep -E "RACECHECK SUMMARY|all results match" \
        "$OUT/racecheck_plan_$p.txt" | tr '\n' ' ' | sed 's/=//g; s/  */ /g')"
    done
  fi
fi
exit 0
