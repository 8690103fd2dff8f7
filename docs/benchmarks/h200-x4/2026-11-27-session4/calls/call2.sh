#!/usr/bin/env bash
# Device call 2 (4 x H200): benches, each alone on the machine, no other GPU process (checked before each).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
B=/tmp/b; mkdir -p $B
bench() {  # name nproc limit suite args...
  local name=$1 np=$2 lim=$3; shift 3
  echo "$name: other GPU processes before: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt
  local t0=$SECONDS
  timeout -k 10 $lim torchrun --standalone --nproc_per_node=$np launch/bench.py "$@" --reps 3 --warmup 1 --out $B/$name > $B/$name.log 2>&1
  echo "$name rc=$? in $((SECONDS - t0)) s" >> $OUT/bench.md
  cat $B/$name/results.md >> $OUT/bench.md 2>/dev/null
}
bench gpt-pp2-compute 2 170 gpt --gpt-configs compute --gpt-variants torch,graph --gpt-anchor-compile off \
  --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,master,compact --gpt-anchor-schedules 1f1b
bench gpt-pp4-compute 4 160 gpt --gpt-configs compute --gpt-variants torch,graph --gpt-anchor-compile off \
  --gpt-schedules 1f1b,zb-h1 --gpt-precisions bf16,compact --gpt-anchor-schedules 1f1b
bench pipeline-pp2 2 220 pipeline --pipeline-configs compute,compute16 --schedules 1f1b,zb-h1 --variants torch,graph \
  --pipeline-anchor-schedules 1f1b,zbv --pipeline-anchor-recipes bf16-params --pipeline-timeline
for f in $B/*.log; do echo "== $f"; grep -vE "^\s*$" $f | tail -n 30; done > $OUT/bench-logs.txt 2>&1
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
ls -la $OUT
