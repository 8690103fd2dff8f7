#!/usr/bin/env bash
# Device call 3 (4 x H200). Phase A, in parallel: GPUs 0,1 the 200-iteration loss curves (master seeds 0 and 1,
# bf16); GPUs 2,3 the compact curve, then the OOM line and the GPT tests call 1's limit cut. Phase B, all four GPUs:
# preempt pp2 x dp2, sharded pp2 x dp2 1F1B (plain and overlapped gather), the 4-rank edge mix, resharding to pp4.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
git log --oneline -1 > $OUT/commit.txt; git status --short | head >> $OUT/commit.txt
G=tests/gpu
mkdir -p /tmp/L
loss() {  # name precision seed
  timeout -k 5 85 torchrun --standalone --nproc_per_node=2 launch/pipeline.py --model gpt --layers 24 --hidden 2048 --heads 16 \
    --seq 2048 --micro-batch-size 1 --microbatches 8 --iters 200 --log-every 1 --precision $2 --seed $3 \
    --metrics-jsonl /tmp/L/$1.jsonl > /tmp/L/$1.log 2>&1
  echo "$1 rc=$?" >> /tmp/L/rc.txt
}
( export CUDA_VISIBLE_DEVICES=0,1; loss master-s0 master 0; loss master-s1 master 1; loss bf16 bf16 0 ) &
( export CUDA_VISIBLE_DEVICES=2,3; loss compact compact 0
  OUT=/tmp/t2 LIMIT=200 TESTS="$G/test_reliability_gpu.py $G/test_gpt_gpu.py $G/test_cross_entropy_gpu.py" \
    bash tools/gpu_checks.sh -v -k "out_of_memory or tied or suite_records or cross_entropy" > /dev/null 2>&1
  cp /tmp/t2/summary.txt $OUT/tests-pair.txt; cp /tmp/t2/logs.tgz /tmp/logs-pair.tgz ) &
wait
echo "phase A done at $SECONDS s; GPU processes left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/commit.txt
OUT=/tmp/t4 LIMIT=250 TESTS="$G/test_preempt_gpu.py $G/test_shard_optimizer_gpu.py $G/test_edges_gpu.py $G/test_checkpoint_reshard_gpu.py" \
  bash tools/gpu_checks.sh -v -k "preempted and pp2dp2 or pp2_dp2_sharded and 1f1b or four_ranks or reshard_four and pp4" > /dev/null 2>&1
cp /tmp/t4/summary.txt $OUT/tests-gpu4.txt
tar -czf $OUT/rest.tgz -C /tmp L logs-pair.tgz t4/logs.tgz 2>/dev/null
ls -la $OUT
