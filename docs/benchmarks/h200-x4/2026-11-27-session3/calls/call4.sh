#!/usr/bin/env bash
# Device call 4: the pp2 x dp2 faults after the naming fix, OOM line, preempt pp2 x dp2, the 4-rank edge mix.
set -u
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/commit.txt; git status --short >> $OUT/commit.txt
G=tests/gpu
OUT=/tmp/t4 LIMIT=195 TESTS="$G/test_reliability_gpu.py $G/test_preempt_gpu.py::test_preempted_with_graphs_and_copy_engine_resumes_equal[pp2dp2] \
$G/test_edges_gpu.py::test_four_ranks_mix_transports" bash tools/gpu_checks.sh -v > /dev/null 2>&1
cp /tmp/t4/summary.txt $OUT/tests-gpu4.txt; cp /tmp/t4/logs.tgz $OUT/logs-gpu4.tgz
