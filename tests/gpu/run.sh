#!/usr/bin/env bash
# Everything that needs GPUs, in one call on the device machine: sets up the environment, then runs every
# tests/gpu/run_*.sh section (or those named: bash tests/gpu/run.sh pipeline kernels), each bounded in time.
# Logs and results go under $OUT (default ./gpu-out). A failing section never stops the others.
set -u
cd "$(dirname "$0")/../.."
# Sections write under $OUT/w; at the end everything is packed into $OUT/logs.tgz (the device tool returns at
# most 8 files) and the summary stays beside it as $OUT/summary.txt.
FINAL=${OUT:-$PWD/gpu-out}
export OUT=$FINAL/w
mkdir -p "$OUT"
exec > >(tee "$FINAL/summary.txt") 2>&1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Wheels carried for what the GPU image lacks (pytest-mpi, rich, matplotlib, ...): see tests/gpu/README.md.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# `import peerline` works from the checkout itself (peerline/__init__.py maps the sibling folders): no build step.
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version(), "cupy", cupy.__version__)'
  nvidia-smi topo -m
} 2>&1 | tee "$OUT/machine.txt"
sections=("$@")
if [ ${#sections[@]} -eq 0 ]; then
  sections=(pipeline kernels p2p buckets single failures bench graph_loop)
fi
# run_section NAME LIMIT: one section, bounded, its PASS/FAIL/GOAL lines echoed.
run_section() {
  local s=$1 limit=$2 f=tests/gpu/run_$1.sh start rc
  [ -f "$f" ] || { echo "SECTION $s: missing"; return; }
  start=$(date +%s)
  timeout "$limit" bash "$f" > "$OUT/section_$s.log" 2>&1
  rc=$?
  { echo "=== SECTION $s rc=$rc in $(( $(date +%s) - start )) s"
    grep -aE "^(PASS|FAIL|SKIP|GOAL|SWEEP|INFO)" "$OUT/section_$s.log" | head -80; } > "$OUT/section_$s.summary"
}
for spec in "${sections[@]}"; do
  names=${spec%%:*}  # NAME, NAME:SECONDS, or A+B:SECONDS (one-GPU sections side by side, one GPU each)
  limit=${SECTION_TIMEOUT:-420}; [ "$spec" != "$names" ] && limit=${spec#*:}
  echo "=== START $names ($(date +%T), limit $limit s)"
  IFS=+ read -ra group <<< "$names"
  if [ ${#group[@]} -eq 1 ]; then
    run_section "$names" "$limit"
  else
    i=0; pids=()
    for s in "${group[@]}"; do CUDA_VISIBLE_DEVICES=$i run_section "$s" "$limit" & pids+=($!); i=$((i + 1)); done
    wait "${pids[@]}"  # not a bare wait: that would also wait for the tee behind this script's own output
  fi
  for s in "${group[@]}"; do cat "$OUT/section_$s.summary" 2>/dev/null; done
done
tar -czf "$FINAL/logs.tgz" -C "$FINAL" w 2>/dev/null && rm -rf "$OUT"
exit 0
